# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Run a unary elementwise op once over a tensor whose slices it reads several times.

Given:   y_i = f(slice(x, d, s_i, e_i))        i = 1..k, k >= 2, one f with one set of arguments
Result:  fx  = f(x)
         y_i = slice(fx, d, s_i, e_i)

Each element of f(x) is f of the element of x at the same place, so a slice of
f(x) holds exactly the values f gives that slice of x: the same values, shapes and
dtype, bit for bit on XNNPACK, whose unary kernels compute every element alike.

Why: a recurrent cell cuts its gate vector in pieces and activates each (an LSTM
step reads three of four gates through sigmoid). On vectors that small XNNPACK's
cost is per op, not per element, so one sigmoid over the whole vector and three
slices of it beat three slices and three sigmoids: the whole LSTM in one delegate
then runs faster than stock's delegate per step.

Bounded by the work it adds: f(x) computes at most half again the elements of the
slices' union along `d`; otherwise declines. Also declines where that share is not
known when lowering (`d` is a symbolic dim), for a quantized input, and for a
dtype XNNPACK does not compile here. Slices along other dims, or read by another f,
form groups of their own.

Runs on the ATen program, before decomposition, after splits are written as slices.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch.export import ExportedProgram

from etfold.backends.xnnpack._passes.delegated_floats import (
    delegated_floats,
    dtype_taken,
    not_quantized,
)
from etfold.decisions import Declined, first_declined, record_applied
from etfold.exir.passes.graph_walk import describe_axes
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy

FOLD = "xnnpack.elementwise_before_slices"

aten = torch.ops.aten
# the unary elementwise ATen ops, each with the partitioner config that takes it
UNARY_ELEMENTWISE: Mapping[torch._ops.OpOverload, str] = {
    aten.abs.default: "abs.default",
    aten.ceil.default: "ceil.default",
    aten.cos.default: "cos.default",
    aten.elu.default: "elu.default",
    aten.exp.default: "exp.default",
    aten.floor.default: "floor.default",
    aten.gelu.default: "gelu.default",
    aten.hardswish.default: "hardswish.default",
    aten.hardtanh.default: "hardtanh.default",
    aten.leaky_relu.default: "leaky_relu.default",
    aten.log.default: "log.default",
    aten.neg.default: "neg.default",
    aten.relu.default: "relu.default",
    aten.rsqrt.default: "rsqrt.default",
    aten.sigmoid.default: "sigmoid.default",
    aten.sin.default: "sin.default",
    aten.sqrt.default: "sqrt.default",
    aten.tanh.default: "tanh.default",
}
MAX_GROWTH = Fraction(3, 2)  # elements of f(x) / elements of the slices' union


@dataclass(frozen=True)
class Hoisted:
    """One f read through k >= 2 slices of `source` along `dim`."""

    op: torch._ops.OpOverload
    args: tuple  # f's arguments after the tensor
    kwargs: tuple  # f's keyword arguments, as sorted items
    dim: int
    readers: tuple[torch.fx.Node, ...]  # each f(slice(source, dim, ...))


@dataclass(frozen=True)
class ElementwiseBeforeSlices:
    source: torch.fx.Node
    groups: tuple[Hoisted, ...]


def _slice_args(node: torch.fx.Node) -> tuple[int, object, object] | None:
    """(dim, start, end) of a stride-1 slice, `dim` normalized; else None."""
    if node.op != "call_function" or node.target is not aten.slice.Tensor:
        return None
    source = node.args[0].meta.get("val")
    if not isinstance(source, torch.Tensor) or source.dim() == 0:
        return None
    dim, start, end, step = (*node.args[1:], *(0, None, None, 1)[len(node.args) - 1 :])[:4]
    return (dim % source.dim(), start, end) if step == 1 else None


def _clamped(index: object, default: int, size: int) -> int:
    if index is None:
        return default
    return min(max(index + size if index < 0 else index, 0), size)


def _union_length(readers: tuple[torch.fx.Node, ...], size: int) -> int:
    """How many positions along the dim the readers' slices cover, overlaps once."""
    ranges = []
    for reader in readers:
        _, start, end = _slice_args(reader.args[0])
        ranges.append((_clamped(start, 0, size), _clamped(end, size, size)))
    length, reached = 0, 0
    for start, end in sorted(ranges):
        start = max(start, reached)
        if end > start:
            length, reached = length + end - start, end
    return length


def _reader_groups(source: torch.fx.Node, ops: Collection) -> dict[tuple, list[torch.fx.Node]]:
    """f nodes reading a slice of `source`, keyed by (f, its other arguments, slice dim)."""
    groups: dict[tuple, list[torch.fx.Node]] = {}
    for piece in source.users:
        sliced = _slice_args(piece)
        if sliced is None or piece.args[0] is not source:
            continue
        for reader in piece.users:
            if reader.op == "call_function" and reader.target in ops and reader.args[0] is piece:
                key = (reader.target, reader.args[1:], tuple(sorted(reader.kwargs.items())))
                groups.setdefault((*key, sliced[0]), []).append(reader)
    return {key: readers for key, readers in groups.items() if len(readers) >= 2}


def _growth_bounded(source: torch.fx.Node, dim: int, readers: tuple) -> Declined | None:
    value = source.meta["val"]
    size = value.shape[dim]
    if type(size) is not int:
        return Declined(
            f"dynamic shape: slices along {describe_axes(value, [dim])}; the share of it "
            "the op would compute changes with the input"
        )
    union = _union_length(readers, size)
    if union == 0 or Fraction(size, union) > MAX_GROWTH:
        return Declined(
            f"the slices hold {union} of {size} along dim {dim}: the op over the whole "
            f"tensor would compute more than {float(MAX_GROWTH)}x their elements"
        )
    return None


def match_elementwise_before_slices(
    node: torch.fx.Node, ops: Collection, dtypes: Collection[torch.dtype]
) -> ElementwiseBeforeSlices | Declined | None:
    """The groups of `node`'s slice readers to hoist, a reason none is, or None when no
    unary op reads two slices of `node`."""
    value = node.meta.get("val")
    groups = _reader_groups(node, ops) if isinstance(value, torch.Tensor) else {}
    if not groups:
        return None
    declined = first_declined(
        lambda: not_quantized(node, "the op over it would need its own quantization"),
        lambda: dtype_taken(value, dtypes, "elementwise op"),
    )
    if declined is not None:
        return declined
    hoisted, reasons = [], []
    for (op, args, kwargs, dim), readers in groups.items():
        declined = _growth_bounded(node, dim, tuple(readers))
        if declined is not None:
            reasons.append(declined)
        else:
            hoisted.append(Hoisted(op, args, kwargs, dim, tuple(readers)))
    if not hoisted:
        return reasons[0]
    return ElementwiseBeforeSlices(node, tuple(hoisted))


def _hoist(source: torch.fx.Node, group: Hoisted) -> None:
    graph, kwargs = source.graph, dict(group.kwargs)
    first = next(node for node in graph.nodes if node in group.readers)
    with graph.inserting_before(first):
        whole = graph.call_function(group.op, (source, *group.args), kwargs)
    whole.meta = {**first.meta, "val": group.op(source.meta["val"], *group.args, **kwargs)}
    for reader in group.readers:
        piece = reader.args[0]
        with graph.inserting_before(reader):
            part = graph.call_function(aten.slice.Tensor, (whole, *piece.args[1:]), piece.kwargs)
        part.meta = {**piece.meta, "val": reader.meta["val"]}
        reader.replace_all_uses_with(part)
        graph.erase_node(reader)
        if not piece.users:
            graph.erase_node(piece)


def rewrite_elementwise_before_slices(match: ElementwiseBeforeSlices) -> None:
    """Each group's f runs once over the source; its readers become slices of that."""
    for group in match.groups:
        _hoist(match.source, group)
        record_applied(
            FOLD,
            match.source.name,
            f"{group.op.__name__} over `{match.source.name}` once, read as "
            f"{len(group.readers)} slices along dim {group.dim}",
        )


def delegated_unary_ops(configs: Collection[str]) -> frozenset:
    """The unary elementwise ops whose partitioner config is among `configs`."""
    return frozenset(op for op, target in UNARY_ELEMENTWISE.items() if target in configs)


def elementwise_ops_before_slices(
    program: ExportedProgram, ops: Collection, *, bf16: bool
) -> ExportedProgram:
    """`program`, or a rewritten copy where some unary op runs once over a tensor
    instead of over several of its slices.

    `ops`: the unary ops the lowering delegates; `bf16`: whether XNNPACK compiles them
    in bf16 here."""
    match = functools.partial(
        match_elementwise_before_slices, ops=frozenset(ops), dtypes=delegated_floats(bf16)
    )
    return rewrite_matches_on_a_copy(program, match, rewrite_elementwise_before_slices, FOLD)
