# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Run an elementwise op once over the tensors whose slices it reads several times.

Given:   y_i = f(slice(x, d, s_i, e_i))                          i = 1..k, k >= 2
         z_i = g(slice(a, d, s_i, e_i), slice(b, d', s_i, e_i))  (d, d' the same dim from the end)
Result:  fx = f(x);     y_i = slice(fx, d, s_i, e_i)
         gab = g(a, b); z_i = slice(gab, D, s_i, e_i)             (D that dim of g(a, b))

f (unary) and g (binary: add, sub, mul, div, maximum, minimum) are elementwise, with
one set of other arguments per group. Each element of f(x) is f of the element of x
at the same place, so a slice of f(x) holds exactly the values f gives that slice of
x, bit for bit on XNNPACK, whose kernels compute every element alike. For g, a and b
have the same size along the sliced dim, so broadcasting pairs the same elements
whole as sliced.

Why: a recurrent cell cuts its gate vectors in pieces and activates each (an LSTM
step reads three of four gates through sigmoid; a GRU step adds two pairs of gate
slices, then applies sigmoid to each sum). On vectors that small XNNPACK's cost is
per op, not per element, so one op over the whole vector and its slices beat an op
per slice: the whole cell in one delegate then runs faster than stock's delegate per
step. Binary groups are hoisted first, so the unary ops after them find slices.

Bounded by the work it adds: the op over the whole tensors computes at most half
again the elements of the slices' union along the dim; otherwise declines. Also
declines where that share is not known when lowering (the dim is symbolic), for a
quantized input, and for a dtype XNNPACK does not compile here. Slices along other
dims, or read by another op, form groups of their own.

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
from etfold.exir.passes.graph_walk import describe_axes, sizes_known_equal
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import axis_index, node_value

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
# the binary elementwise ATen ops, each with its config
BINARY_ELEMENTWISE: Mapping[torch._ops.OpOverload, str] = {
    aten.add.Tensor: "add.Tensor",
    aten.div.Tensor: "div.Tensor",
    aten.maximum.default: "maximum.default",
    aten.minimum.default: "minimum.default",
    aten.mul.Tensor: "mul.Tensor",
    aten.sub.Tensor: "sub.Tensor",
}
MAX_GROWTH = Fraction(3, 2)  # elements of the op over the whole / elements of the slices' union


@dataclass(frozen=True)
class Sliced:
    """A stride-1 slice of `source` along the dim `axis` from the end (negative)."""

    source: torch.fx.Node
    axis: int
    start: object
    end: object

    @property
    def size(self) -> object:
        return node_value(self.source).shape[self.axis]

    def bounds(self) -> tuple[int, int]:
        """(start, end) clamped to the static size along the axis."""
        return _clamped(self.start, 0, self.size), _clamped(self.end, self.size, self.size)


@dataclass(frozen=True)
class Hoisted:
    """One op read through k >= 2 slices of its `sources`, each along `axis`."""

    op: torch._ops.OpOverload
    sources: tuple[torch.fx.Node, ...]
    args: tuple  # the op's arguments after its tensors
    kwargs: tuple  # its keyword arguments, as sorted items
    axis: int  # from the end (negative)
    readers: tuple[torch.fx.Node, ...]  # each op(slice(source, ...), ...)


@dataclass(frozen=True)
class ElementwiseBeforeSlices:
    source: torch.fx.Node  # the first operand's source
    groups: tuple[Hoisted, ...]


_SLICE_DEFAULTS = (("dim", 0), ("start", None), ("end", None), ("step", 1))
_SLICE_ARGUMENTS = tuple(name for name, _ in _SLICE_DEFAULTS)


def _sliced(node: object) -> Sliced | None:
    """`node` as a stride-1 slice; else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is not aten.slice.Tensor:
        return None
    source = node_value(node.args[0])
    if not isinstance(source, torch.Tensor) or source.dim() == 0:
        return None
    given = dict(zip(_SLICE_ARGUMENTS, node.args[1:], strict=False)) | node.kwargs
    dim, start, end, step = (given.get(name, default) for name, default in _SLICE_DEFAULTS)
    if step != 1:
        return None
    return Sliced(node.args[0], axis_index(dim, source.dim()) - source.dim(), start, end)


def _clamped(index: object, default: int, size: int) -> int:
    if index is None:
        return default
    return min(max(index + size if index < 0 else index, 0), size)


def _operands(reader: torch.fx.Node, arity: int) -> tuple[Sliced, ...] | None:
    """The slices `reader`'s tensor operands are, when all are slices along one dim from
    the end, of one size and with one (start, end); else None."""
    pieces = [_sliced(arg) for arg in reader.args[:arity]]
    if len(pieces) < arity or any(piece is None for piece in pieces):
        return None
    first = pieces[0]
    for piece in pieces[1:]:
        same_place = (piece.axis, piece.start, piece.end) == (first.axis, first.start, first.end)
        if not same_place or not sizes_known_equal(piece.size, first.size):
            return None
    return tuple(pieces)


def _union_length(pieces: list[Sliced]) -> int:
    """How many positions along the dim the slices cover, overlaps once."""
    length, reached = 0, 0
    for start, end in sorted(piece.bounds() for piece in pieces):
        start = max(start, reached)
        if end > start:
            length, reached = length + end - start, end
    return length


def _reader_groups(source: torch.fx.Node, ops: Mapping) -> dict[tuple, list[torch.fx.Node]]:
    """Ops whose first operand is a slice of `source`, keyed by (op, the sources, the
    other arguments, the dim): each group one op over whole tensors."""
    groups: dict[tuple, list[torch.fx.Node]] = {}
    for piece in source.users:
        for reader in piece.users:
            if reader.op != "call_function" or reader.args[0] is not piece:
                continue
            arity = ops.get(reader.target)
            pieces = _operands(reader, arity) if arity else None
            if pieces is None or pieces[0].source is not source:
                continue
            sources = tuple(p.source for p in pieces)
            kwargs = tuple(sorted(reader.kwargs.items()))
            key = (reader.target, sources, reader.args[arity:], kwargs, pieces[0].axis)
            groups.setdefault(key, []).append(reader)
    return {key: readers for key, readers in groups.items() if len(readers) >= 2}


def _growth_bounded(group: Hoisted) -> Declined | None:
    pieces = [_sliced(reader.args[0]) for reader in group.readers]
    size, value = pieces[0].size, node_value(group.sources[0])
    if type(size) is not int:
        return Declined(
            f"dynamic shape: slices along {describe_axes(value, [value.dim() + group.axis])};"
            " the share of it the op would compute changes with the input"
        )
    union = _union_length(pieces)
    if union == 0 or Fraction(size, union) > MAX_GROWTH:
        return Declined(
            f"the slices hold {union} of {size} along dim {value.dim() + group.axis}: the op "
            f"over the whole would compute more than {float(MAX_GROWTH)}x their elements"
        )
    return None


def _sources_taken(sources: tuple, dtypes: Collection[torch.dtype]) -> Declined | None:
    for source in dict.fromkeys(sources):
        declined = first_declined(
            lambda s=source: not_quantized(s, "the op over it would need its own quantization"),
            lambda s=source: dtype_taken(node_value(s), dtypes, "elementwise op"),
        )
        if declined is not None:
            return declined
    return None


def _group_declined(group: Hoisted, dtypes: Collection[torch.dtype]) -> Declined | None:
    return first_declined(
        lambda: _sources_taken(group.sources, dtypes), lambda: _growth_bounded(group)
    )


def match_elementwise_before_slices(
    node: torch.fx.Node, ops: Mapping, dtypes: Collection[torch.dtype]
) -> ElementwiseBeforeSlices | Declined | None:
    """The groups of ops reading slices of `node` (as their first operand) to hoist, a
    reason none is, or None when no op of `ops` (op -> its tensor operands) reads two
    slices of `node`."""
    if not isinstance(node_value(node), torch.Tensor):
        return None
    hoisted, reasons = [], []
    for (op, sources, args, kwargs, axis), readers in _reader_groups(node, ops).items():
        group = Hoisted(op, sources, args, kwargs, axis, tuple(readers))
        declined = _group_declined(group, dtypes)
        if declined is not None:
            reasons.append(declined)
        else:
            hoisted.append(group)
    if hoisted:
        return ElementwiseBeforeSlices(node, tuple(hoisted))
    return reasons[0] if reasons else None


def _hoist(group: Hoisted) -> None:
    graph, kwargs = group.readers[0].graph, dict(group.kwargs)
    first = next(node for node in graph.nodes if node in group.readers)
    values = [node_value(source) for source in group.sources]
    with graph.inserting_before(first):
        whole = graph.call_function(group.op, (*group.sources, *group.args), kwargs)
    whole.meta = {**first.meta, "val": group.op(*values, *group.args, **kwargs)}
    dim = node_value(whole).dim() + group.axis
    for reader in group.readers:
        pieces = dict.fromkeys(reader.args[: len(group.sources)])
        start, end = _sliced(reader.args[0]).bounds()
        with graph.inserting_before(reader):
            part = graph.call_function(aten.slice.Tensor, (whole, dim, start, end))
        part.meta = {**reader.args[0].meta, "val": node_value(reader)}
        reader.replace_all_uses_with(part)
        graph.erase_node(reader)
        for piece in pieces:
            if not piece.users:
                graph.erase_node(piece)


def rewrite_elementwise_before_slices(match: ElementwiseBeforeSlices) -> None:
    """Each group's op runs once over its whole sources; its readers become slices."""
    for group in match.groups:
        _hoist(group)
        names = ", ".join(f"`{source.name}`" for source in group.sources)
        dim = node_value(group.sources[0]).dim() + group.axis
        record_applied(
            FOLD,
            match.source.name,
            f"{group.op.__name__} over {names} once, read as {len(group.readers)} slices "
            f"along dim {dim}",
        )


def delegated_elementwise_ops(configs: Collection[str]) -> dict:
    """The elementwise ops whose partitioner config is among `configs`, each with the
    number of tensor operands it reads."""
    unary = {op: 1 for op, target in UNARY_ELEMENTWISE.items() if target in configs}
    binary = {op: 2 for op, target in BINARY_ELEMENTWISE.items() if target in configs}
    return {**binary, **unary}


def elementwise_ops_before_slices(
    program: ExportedProgram, ops: Mapping, *, bf16: bool
) -> ExportedProgram:
    """`program`, or a rewritten copy where some elementwise op runs once over whole
    tensors instead of over several of their slices.

    `ops`: the elementwise ops the lowering delegates, each with its tensor operands
    (`delegated_elementwise_ops`); `bf16`: whether XNNPACK compiles them in bf16 here.
    Binary ops first: a unary op reading their results then reads slices."""
    dtypes = delegated_floats(bf16)
    for arity in (2, 1):
        kind = {op: n for op, n in ops.items() if n == arity}
        match = functools.partial(match_elementwise_before_slices, ops=kind, dtypes=dtypes)
        program = rewrite_matches_on_a_copy(program, match, rewrite_elementwise_before_slices, FOLD)
    return program
