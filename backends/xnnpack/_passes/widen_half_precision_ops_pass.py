# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Compute half-precision ops that have no accurate (or no XNNPACK) kernel in fp32,
between two converts.

    y = op(x, w, ...)                    x, w, y: float16 or bfloat16
      -> y = to_half(op(to_fp32(x), to_fp32(w), ...))

for the ops in `WIDENED_OPS`, each with the half dtypes it is widened in and the
kernel behaviour that puts it there (measured against the fp32 eager result on
the executorch 1.5.1 runtime, widths 256-1024; PyTorch's own CPU kernels compute
these ops in fp32 and round once, so the widened form is the function eager
computes). The converts of activations are delegated as XNNPACK converts; the
widened op runs in fp32 on XNNPACK when it takes it there, else on portable
kernels, which are accurate in fp32. bf16 batched matmul and mean have no
XNNPACK kernel here, so each would split the delegate; widened, they join it
(the mean through the pass that writes it as pooling, which runs after this one).
Runs on the ATen program, before decomposition: a batched matmul is still one
`matmul` node here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from etfold.decisions import Declined, record_applied
from etfold.exir.passes.graph_walk import convert_every_use, insert_to_copy
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import argument_values, rank_of, tensor_value

FOLD = "xnnpack.widen_half_precision_ops"

aten = torch.ops.aten
_HALF = frozenset({torch.float16, torch.bfloat16})


@dataclass(frozen=True)
class WideningRule:
    dtypes: frozenset[torch.dtype]
    why: str
    # where the op is widened at all; None: everywhere (a node outside is not a match)
    only_where: Callable[[torch.fx.Node], bool] | None = None


def batched_on_both_sides(node: torch.fx.Node) -> bool:
    """A matmul whose two operands both have rank >= 3: what ATen decomposes into `bmm`
    (with one operand of rank <= 2 it folds the batch into an `mm`, which XNNPACK runs
    in bf16)."""
    ranks = [rank_of(a) for a in node.args[:2]]
    return None not in ranks and min(ranks) >= 3


# measured max |error| vs fp32 eager at width 1024 (fp16 / bf16), PyTorch eager in brackets
_NORM = "portable kernel accumulates in half (layer_norm: 4.0 / 1.6 [0.002 / 0.015])"
_VAR = "portable kernel accumulates in half (var: 0.014 / 0.22 [0.0004 / 0.003])"
_CUMSUM = "portable kernel accumulates in half (cumsum: 3.4 / 30 [0.25 / 2.1])"
_SOFTMAX = (
    "XNNPACK's fp16 softmax is 3.5x less accurate than eager (0.0034 [0.001]); "
    "its bf16 softmax does not compile"
)
_BF16 = frozenset({torch.bfloat16})  # their fp16 forms compile and run on XNNPACK
# bf16 vs fp32 eager at width 1024: widened [eager bf16]; one bf16 rounding either way
_BMM = (
    "XNNPACK's bf16 bmm does not compile, so attention's q @ k^T and p @ v split the "
    "delegate (widened: 0.25, bit for bit eager's [0.25])"
)
_MEAN = (
    "XNNPACK's bf16 mean does not compile, so RMSNorm's mean of x^2 splits the delegate "
    "(widened: 0.0039, one bf16 ulp from eager [0.0040])"
)
_CONV = (
    "XNNPACK's bf16 convolution does not compile, so a ViT's patch embedding or an audio "
    "encoder's stem runs on portable kernels outside the delegate (widened: the fp32 "
    "convolution of the bf16 values, rounded once, as eager's bf16 convolution computes it)"
)

WIDENED_OPS: dict[torch._ops.OpOverload, WideningRule] = {
    aten.layer_norm.default: WideningRule(_HALF, _NORM),
    aten.var.dim: WideningRule(_HALF, _VAR),
    aten.var.correction: WideningRule(_HALF, _VAR),
    aten.cumsum.default: WideningRule(_HALF, _CUMSUM),
    aten.softmax.int: WideningRule(_HALF, _SOFTMAX),
    aten._softmax.default: WideningRule(_HALF, _SOFTMAX),
    aten.gelu.default: WideningRule(
        frozenset({torch.float16}), "XNNPACK has no fp16 GELU; upstream leaves it to portable"
    ),
    aten.matmul.default: WideningRule(_BF16, _BMM, only_where=batched_on_both_sides),
    aten.bmm.default: WideningRule(_BF16, _BMM),
    aten.mean.dim: WideningRule(_BF16, _MEAN),
    aten.conv1d.default: WideningRule(_BF16, _CONV),
    aten.conv2d.default: WideningRule(_BF16, _CONV),
    aten.convolution.default: WideningRule(_BF16, _CONV),
}


@dataclass(frozen=True)
class HalfPrecisionOp:
    node: torch.fx.Node
    dtype: torch.dtype  # its tensor arguments in this dtype are converted to fp32
    rule: WideningRule


def _tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.fx.Node)]


def has_tensor_metadata(node: torch.fx.Node) -> bool:
    return tensor_value(node) is not None and all(
        tensor_value(a) is not None for a in _tensor_args(node)
    )


def computes_in(node: torch.fx.Node, dtype: torch.dtype) -> bool:
    """The op's output has its input's half dtype (no dtype= argument widens it already)."""
    return tensor_value(node).dtype is dtype


def other_tensors_are_half_or_fp32(node: torch.fx.Node, dtype: torch.dtype) -> bool:
    return all(tensor_value(a).dtype in (dtype, torch.float32) for a in _tensor_args(node))


def match_half_precision_op(node: torch.fx.Node) -> HalfPrecisionOp | Declined | None:
    """None for ops outside the table or not in a widened dtype (nothing worth recording)."""
    rule = WIDENED_OPS.get(node.target) if node.op == "call_function" else None
    if rule is not None and rule.only_where is not None and not rule.only_where(node):
        return None
    source = tensor_value(node.args[0]) if rule is not None and node.args else None
    if rule is None or (source is not None and source.dtype not in rule.dtypes):
        return None
    if not has_tensor_metadata(node):
        return Declined("the op or one of its tensor arguments has no tensor metadata")
    dtype = source.dtype
    if tensor_value(node).dtype is torch.float32:
        return None  # asked to compute in fp32 already (softmax(x, dim, dtype=torch.float32))
    if not computes_in(node, dtype):
        return Declined(
            f"the op already returns {tensor_value(node).dtype}, not its input's {dtype}"
        )
    if not other_tensors_are_half_or_fp32(node, dtype):
        return Declined(f"a tensor argument is neither {dtype} nor float32")
    return HalfPrecisionOp(node, dtype, rule)


def rewrite_half_precision_op(match: HalfPrecisionOp) -> None:
    node, graph = match.node, match.node.graph
    # read now, not when matched: a widened op before this one (softmax before the
    # matmul reading it) has put its narrowing convert between them since
    half_args = dict.fromkeys(a for a in _tensor_args(node) if tensor_value(a).dtype is match.dtype)
    with graph.inserting_before(node):
        for source in half_args:
            node.replace_input_with(source, insert_to_copy(graph, source, dtype=torch.float32))
    args, kwargs = argument_values((node.args, node.kwargs))
    node.meta["val"] = node.target(*args, **kwargs)
    convert_every_use(graph, node, dtype=match.dtype)
    record_applied(
        FOLD,
        node.name,
        f"{node.target} in {match.dtype} computed in float32 between two converts: "
        f"{match.rule.why}",
    )


def widen_half_precision_ops(program: ExportedProgram) -> ExportedProgram:
    """The program with every matched op widened: a rewritten copy when something
    matches (the program handed in may be the user's), else the program itself."""
    return rewrite_matches_on_a_copy(
        program, match_half_precision_op, rewrite_half_precision_op, FOLD
    )
