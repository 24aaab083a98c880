# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Read what a lowering produced: delegates, ops left outside, TOSA operators, sizes."""

from __future__ import annotations

from collections import Counter

import torch
from executorch.exir.lowered_backend_module import LoweredBackendModule
from torch.export import ExportedProgram

_DELEGATE_CALL = torch.ops.higher_order.executorch_call_delegate


def _graph_module(program) -> torch.fx.GraphModule:
    if isinstance(program, ExportedProgram):
        return program.graph_module
    if isinstance(program, torch.fx.GraphModule):
        return program
    raise TypeError(f"expected an ExportedProgram or GraphModule, got {type(program).__name__}")


def op_name(target) -> str:
    """A stable, readable name for a call_function target (`aten.add.Tensor`)."""
    name = getattr(target, "_name", None) or getattr(target, "__name__", None) or str(target)
    if "::" in name:
        namespace, rest = name.split("::", 1)
        return f"{namespace}.{rest}" if "." in rest else f"{namespace}.{rest}.default"
    return name


def every_op_overload():
    """Every overload of every op `torch.ops` holds so far, namespace by namespace."""
    for name in list(torch.ops._dir):
        namespace = getattr(torch.ops, name)
        if isinstance(namespace, torch._ops._OpNamespace):
            for packet in list(namespace):
                yield from getattr(namespace, packet).op_overloads()


def lowered_modules(program) -> list[LoweredBackendModule]:
    graph_module = _graph_module(program)
    return [
        getattr(graph_module, node.args[0].target)
        for node in graph_module.graph.nodes
        if node.op == "call_function" and node.target is _DELEGATE_CALL
    ]


def delegate_count(program) -> int:
    return len(lowered_modules(program))


def ops_outside_delegates(program) -> Counter[str]:
    """call_function targets left at top level, excluding delegate calls and getitem."""
    graph_module = _graph_module(program)
    counts: Counter[str] = Counter()
    for node in _outside_delegates(graph_module.graph):
        counts[op_name(node.target)] += 1
    return counts


def _outside_delegates(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The graph's call_function nodes that are neither delegate calls nor getitems."""
    return [
        node
        for node in graph.nodes
        if node.op == "call_function"
        and node.target is not _DELEGATE_CALL
        and getattr(node.target, "__name__", "") != "getitem"
    ]


def _tosa_blocks(tosa_graph: bytes):
    """Every basic block of a serialized TOSA graph, region by region."""
    from tosa.TosaGraph import TosaGraph

    graph = TosaGraph.GetRootAs(tosa_graph, 0)
    for r in range(graph.RegionsLength()):
        region = graph.Regions(r)
        for b in range(region.BlocksLength()):
            yield region.Blocks(b)


def _tosa_operators(tosa_graph: bytes):
    """(kind, operator, block) for every operator of a serialized TOSA graph."""
    from tosa.Op import Op

    names = {value: name for name, value in vars(Op).items() if not name.startswith("_")}
    for block in _tosa_blocks(tosa_graph):
        for o in range(block.OperatorsLength()):
            operator = block.Operators(o)
            yield names[operator.Op()], operator, block


def _tosa_tensor_shapes(block) -> dict[bytes, list[int]]:
    """Each tensor's shape by its serialized name (bytes, as operators name their inputs)."""
    return {
        tensor.Name(): [int(d) for d in tensor.ShapeAsNumpy()] if tensor.ShapeLength() else []
        for tensor in (block.Tensors(t) for t in range(block.TensorsLength()))
    }


def tosa_unsized_inputs(tosa_graph: bytes) -> list[str]:
    """Graph inputs with a dimension left unsized (-1): the export had dynamic shapes.

    The reference model runs static shapes only; given such a graph it aborts and
    prints a debugger's backtrace for seconds before returning an error, so check first.
    """
    unsized = []
    for block in _tosa_blocks(tosa_graph):
        shapes = _tosa_tensor_shapes(block)
        for i in range(block.InputsLength()):
            name = block.Inputs(i)
            if any(d < 0 for d in shapes.get(name, [])):
                unsized.append(f"{name.decode()} {shapes[name]}")
    return unsized


def tosa_operator_counts(tosa_graph: bytes) -> Counter[str]:
    """TOSA operators by kind (`CONV2D`, `RESCALE`, …), read from the flatbuffer."""
    return Counter(kind for kind, _, _ in _tosa_operators(tosa_graph))


# the input-channel axis of each convolution's weight (TOSA layouts: OHWI, HWCM, OHWI)
_WEIGHT_INPUT_CHANNEL_AXIS = {"CONV2D": 3, "TRANSPOSE_CONV2D": 3, "DEPTHWISE_CONV2D": 2}


def tosa_channel_conflicts(tosa_graph: bytes) -> list[str]:
    """Convolutions whose NHWC input does not have the channels their weight reads.

    Such a graph is malformed (a layout transpose went missing); the reference
    model rejects it and then crashes its host process, so check before running.
    """
    conflicts = []
    for kind, operator, block in _tosa_operators(tosa_graph):
        axis = _WEIGHT_INPUT_CHANNEL_AXIS.get(kind)
        if axis is None or operator.InputsLength() < 2:
            continue
        shapes = _tosa_tensor_shapes(block)
        given, weight = shapes.get(operator.Inputs(0), []), shapes.get(operator.Inputs(1), [])
        if given and len(weight) > axis and given[-1] != weight[axis]:
            conflicts.append(f"{kind} reads {given[-1]} input channels, its weight {weight[axis]}")
    return conflicts


def ops_outside_reading_no_user_input(program: ExportedProgram) -> list[tuple[str, str]]:
    """(node name, op) of each op outside delegates that no user input reaches.

    Such an op computes from constants alone at runtime: a fold left it there, or
    a decline (recorded under the node's name) kept it.
    """
    from etfold.backends.xnnpack._passes.dtype_convert_match import reads_user_input

    return [
        (node.name, op_name(node.target))
        for node in _outside_delegates(program.graph)
        if not reads_user_input(node, program)
    ]
