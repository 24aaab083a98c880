# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Which copies are pure float dtype converts that XNNPACK can run.

    _to_dim_order_copy(x, dtype=d)      (dim order of x kept)
    _to_copy(x, dtype=d)                (memory format of x kept)
      == convert(x, d)                  when {dtype(x), d} is {fp32, fp16} or {fp32, bf16}

`convert` is XNNPACK's element-wise convert node: round to nearest even,
layout untouched. The partitioner configs and the preprocess rewrite both ask
`match_dtype_convert`, so they accept exactly the same nodes.
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass

import torch
from executorch.backends.xnnpack.utils.quant_utils import is_dequant, is_quant
from executorch.exir.dialects._ops import ops as exir_ops
from torch.export import ExportedProgram

from etfold.decisions import Declined
from etfold.exir.passes.graph_walk import ancestors
from etfold.exir.passes.node_shapes import tensor_value

FOLD = "xnnpack.delegate_dtype_convert"

TO_DIM_ORDER_COPY = exir_ops.edge.dim_order_ops._to_dim_order_copy.default
TO_COPY = exir_ops.edge.aten._to_copy.default
COPY_TARGETS = (TO_DIM_ORDER_COPY, TO_COPY)

# What a matched copy becomes inside an etfold-marked delegate: the op that
# means exactly "element-wise dtype convert, layout preserved". Upstream's
# preprocess passes special-case only `_to_copy`, so this op gets their generic
# treatment (its layout follows its input; never removed as a redundant copy).
CONVERT_TARGET = exir_ops.edge.prims.convert_element_type.default

NARROW_FLOATS = (torch.float16, torch.bfloat16)

_DELEGATE_CALL = torch.ops.higher_order.executorch_call_delegate


@dataclass(frozen=True)
class DtypeConvert:
    node: torch.fx.Node
    source: torch.dtype
    target: torch.dtype

    def describe(self) -> str:
        return f"{_short(self.source)} -> {_short(self.target)}"


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_copy(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in COPY_TARGETS


def has_tensor_meta(node: torch.fx.Node) -> bool:
    return tensor_value(node) is not None and tensor_value(node.args[0]) is not None


def changes_dtype(node: torch.fx.Node) -> bool:
    return tensor_value(node).dtype != tensor_value(node.args[0]).dtype


def is_fp32_pair(source: torch.dtype, target: torch.dtype) -> bool:
    """One side fp32, the other fp16 or bf16."""
    return (source == torch.float32 and target in NARROW_FLOATS) or (
        target == torch.float32 and source in NARROW_FLOATS
    )


def _requested_layout_matches(node: torch.fx.Node, source: torch.Tensor) -> bool:
    if node.target == TO_DIM_ORDER_COPY:
        requested = node.kwargs.get("dim_order")
        return requested is None or tuple(requested) == tuple(source.dim_order())
    memory_format = node.kwargs.get("memory_format")
    if memory_format in (None, torch.preserve_format):
        return True
    return source.is_contiguous(memory_format=memory_format)


def keeps_layout(node: torch.fx.Node) -> bool:
    """The copy asks for the layout its input already has, and its output has it."""
    source, result = tensor_value(node.args[0]), tensor_value(node)
    return _requested_layout_matches(node, source) and tuple(result.dim_order()) == tuple(
        source.dim_order()
    )


def touches_quantization(node: torch.fx.Node) -> bool:
    """Reads a dequantize or feeds a quantize: XNNPACK would fold the q/dq into the convert."""
    return is_dequant(node.args[0]) or any(is_quant(user) for user in node.users)


def _delegate_output(node: torch.fx.Node) -> tuple[torch.fx.Node, int] | None:
    if node.op == "call_function" and node.target is operator.getitem:
        call, index = node.args
        if isinstance(call, torch.fx.Node) and call.target is _DELEGATE_CALL:
            return call, index
    return None


def _inputs_read(node: torch.fx.Node, graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """What `node` reads; one output of a delegate reads only the call inputs it depends on."""
    delegate_output = _delegate_output(node)
    if delegate_output is None:
        return list(node.all_input_nodes)
    call, index = delegate_output
    submodule = getattr(graph_module, call.args[0].target).original_module
    result = submodule.graph.output_node().args[0][index]
    positions = {name: i for i, name in enumerate(submodule.graph_signature.user_inputs)}
    return [
        call.args[1 + positions[p.name]]
        for p in ancestors(result)
        if p.op == "placeholder" and p.name in positions
    ]


def reads_user_input(node: torch.fx.Node, program: ExportedProgram) -> bool:
    """Some user input reaches `node`: it converts an activation, not a constant.

    Sees through delegate calls, so it answers the same before and after lowering.
    """
    user_inputs = set(program.graph_signature.user_inputs)
    seen: set[torch.fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder" and current.name in user_inputs:
            return True
        stack.extend(_inputs_read(current, program.graph_module))
    return False


def match_dtype_convert(node: torch.fx.Node) -> DtypeConvert | Declined:
    """Structure only: whether `node` is a float convert XNNPACK runs as is.

    Whether its input is an activation is a question about the whole program
    (`reads_user_input`), asked by the partitioner config.
    """
    if not is_copy(node):
        return Declined("not a _to_copy or _to_dim_order_copy")
    if not has_tensor_meta(node):
        return Declined("no tensor metadata on the copy or its input")
    source, target = tensor_value(node.args[0]).dtype, tensor_value(node).dtype
    if not changes_dtype(node):
        return Declined("the copy keeps its dtype")
    if not is_fp32_pair(source, target):
        return Declined(
            f"{_short(source)} -> {_short(target)}: only float32 <-> float16/bfloat16 "
            "converts are delegated"
        )
    if not keeps_layout(node):
        return Declined("the copy changes dtype and layout at once")
    if touches_quantization(node):
        return Declined("the copy reads a dequantize or feeds a quantize node")
    return DtypeConvert(node, source, target)


def _is_copy_by_name(node: torch.fx.Node) -> bool:
    """Edge copies and, after `to_executorch`, their out variants."""
    name = getattr(node.target, "__name__", "")
    parts = set(name.split("."))
    return node.op == "call_function" and bool(parts & {"_to_copy", "_to_dim_order_copy"})


def float_converts_outside_delegates(program: ExportedProgram) -> Counter[str]:
    """Top-level float -> float copies that change dtype, as "activation" or "constant".

    "constant" means no user input reaches the copy (a cast buffer, a mask or a
    rotary table computed from constants): those belong to constant folding.
    """
    counts: Counter[str] = Counter()
    for node in program.graph_module.graph.nodes:
        if not (_is_copy_by_name(node) and has_tensor_meta(node) and changes_dtype(node)):
            continue
        source, target = tensor_value(node.args[0]).dtype, tensor_value(node).dtype
        if not (source.is_floating_point and target.is_floating_point):
            continue
        counts["activation" if reads_user_input(node, program) else "constant"] += 1
    return counts
