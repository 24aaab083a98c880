# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Write a split the partitioner refuses as the slices XNNPACK runs.

Given:   parts = split_with_sizes(x, [n0, n1, ...], dim)   (or split, or chunk)
         y_i = parts[i]
Result:  y_i = slice(x, dim, s_i, s_i + n_i)               s_i = n0 + ... + n(i-1)

Piece i of a split along `dim` is, element for element, the slice of `x` that
starts where the pieces before it end and spans its own size: the same values,
the same shape. ExecuTorch's XNNPACK partitioner has no config for
`split_with_sizes_copy`, so every split (a fused QKV projection, a gate/up
pair, a chunked rotary half) stays on portable kernels and cuts the delegate
in two; upstream delegates a static `slice_copy` with stride 1.

On a dynamic export the pieces keep the symbolic dims whole (a fused QKV split
along its static last dim of a `[1, T, 3D]` activation): those slices resize at
runtime (`dynamic_slices`), so the split is rewritten as in a static export.

Declines where the slices would not all join a delegate: a split whose pieces
are used as a list (not each by index), a split along a symbolic dim (its bounds
change with the input) or an empty piece, a dtype XNNPACK does not compile here,
a quantized input, or a rank beyond XNNPACK's.

A `select` (or an `unbind` read by index) is the slice of size 1 at its index, viewed
without that dim: `select(x, d, i) = view(slice(x, d, i, i + 1), shape)`; upstream has
no select config, so rotary embedding's real/imaginary split stays outside otherwise.

Runs on the ATen program, before decomposition.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from etfold.backends.xnnpack._passes.delegated_floats import (
    delegated_floats,
    dtype_taken,
    not_quantized,
    rank_held,
)
from etfold.backends.xnnpack._passes.dynamic_slices import slice_resizes_at_runtime
from etfold.backends.xnnpack._passes.shape_ops_as_views_pass import view_shape
from etfold.decisions import Declined, first_declined, record_applied
from etfold.exir.passes.graph_walk import describe_axes
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import axis_index, node_value, rank_of

FOLD = "xnnpack.split_as_slices"

aten = torch.ops.aten
SPLITS = (aten.split_with_sizes.default, aten.split.Tensor, aten.chunk.default)
SELECTS = (aten.select.int, aten.unbind.int)


@dataclass(frozen=True)
class SplitAsSlices:
    node: torch.fx.Node
    dim: int
    bounds: tuple[tuple[int, int], ...]  # (start, end) of each piece along `dim`


def _dim(node: torch.fx.Node, rank: int) -> int:
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    return axis_index(dim, rank)


def piece_bounds(sizes: list[int]) -> tuple[tuple[int, int], ...]:
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    return tuple(zip([0, *ends[:-1]], ends, strict=True))


def _pieces_by_index(node: torch.fx.Node) -> Declined | None:
    if any(user.target is not operator.getitem for user in node.users):
        return Declined("the pieces are used as a list: only pieces read by index become slices")
    return None


def _piece_sizes(node: torch.fx.Node, dim: int) -> list[int] | Declined:
    """Each piece's size along `dim`, when every piece is a slice XNNPACK runs: static
    along `dim`, its symbolic dims (a dynamic export) kept whole and resized at runtime."""
    pieces, source = node_value(node), node_value(node.args[0])
    if not isinstance(pieces, (list, tuple)) or not pieces:
        return Declined("no metadata on the split's pieces")
    if not all(isinstance(piece, torch.Tensor) for piece in pieces):
        return Declined("no metadata on the split's pieces")
    sizes = [piece.shape[dim] for piece in pieces]
    if not all(type(size) is int for size in sizes):
        return Declined(
            f"dynamic shape: splits {describe_axes(source, [dim])}; the slice bounds change "
            "with the input"
        )
    if 0 in sizes or any(type(s) is int and s == 0 for s in source.shape):
        return Declined(f"an empty piece (sizes {sizes}): XNNPACK takes no empty tensors")
    for piece, (start, end) in zip(pieces, piece_bounds(sizes), strict=True):
        declined = slice_resizes_at_runtime(source, piece, dim, start, end)
        if declined is not None:
            return declined
    return sizes


def match_split_as_slices(
    node: torch.fx.Node, dtypes: Collection[torch.dtype]
) -> SplitAsSlices | Declined | None:
    """The slices `node` becomes, a reason it stays, or None when it is not a split."""
    if node.op != "call_function" or node.target not in SPLITS:
        return None
    source = node.args[0]
    rank = rank_of(source)
    if rank is None:
        return Declined("no tensor metadata on the split's input")
    declined = first_declined(
        lambda: rank_held(rank, "input"),
        lambda: _pieces_by_index(node),
        lambda: not_quantized(source, "the slices would need matching quantization each"),
        lambda: dtype_taken(node_value(source), dtypes, "split"),
    )
    if declined is not None:
        return declined
    sizes = _piece_sizes(node, _dim(node, rank))
    if isinstance(sizes, Declined):
        return sizes
    return SplitAsSlices(node, _dim(node, rank), piece_bounds(sizes))


def rewrite_as_slices(match: SplitAsSlices) -> None:
    """Each `parts[i]` becomes a slice of the split's input; the split goes."""
    node, graph = match.node, match.node.graph
    source = node.args[0]
    for piece in list(node.users):
        start, end = match.bounds[piece.args[1]]
        with graph.inserting_before(piece):
            part = graph.call_function(aten.slice.Tensor, (source, match.dim, start, end, 1))
        part.meta = {**node.meta, "val": node_value(piece)}
        piece.replace_all_uses_with(part)
        graph.erase_node(piece)
    graph.erase_node(node)
    record_applied(FOLD, node.name, f"{len(match.bounds)} pieces along dim {match.dim}")


@dataclass(frozen=True)
class SelectsAsSlices:
    """`select(x, d, i)`, or `unbind(x, d)` read by index: each selected slab is
    `view(slice(x, d, i, i + 1), shape of the slab)`, the same values (rotary's
    real/imaginary split of `[1, T, H, D/2, 2]`)."""

    node: torch.fx.Node
    dim: int
    shapes: dict[int, tuple[int, ...]]  # index -> the view's size argument (-1: inferred)


def _selected(node: torch.fx.Node) -> dict[int, torch.fx.Node]:
    """Index -> the node holding that slab: the select itself, or unbind's getitems."""
    if node.target is aten.select.int:
        return {node.args[2]: node}
    return {piece.args[1]: piece for piece in node.users}


def match_selects_as_slices(
    node: torch.fx.Node, dtypes: Collection[torch.dtype]
) -> SelectsAsSlices | Declined | None:
    """The slices and views `node` becomes, a reason it stays, or None when it is no
    select or unbind."""
    if node.op != "call_function" or node.target not in SELECTS:
        return None
    source = node.args[0]
    rank = rank_of(source)
    if rank is None or rank == 0:
        return Declined("no tensor metadata on the select's input")
    value = node_value(source)
    dim = axis_index(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), rank)
    declined = first_declined(
        lambda: rank_held(rank, "input"),
        lambda: _pieces_by_index(node) if node.target is aten.unbind.int else None,
        lambda: not_quantized(source, "the slices would need matching quantization each"),
        lambda: dtype_taken(value, dtypes, "select"),
    )
    if declined is not None:
        return declined
    if type(value.shape[dim]) is not int:
        return Declined(
            f"dynamic shape: selects along {describe_axes(value, [dim])}; the slice bounds "
            "change with the input"
        )
    shapes = {}
    for index, piece in _selected(node).items():
        index %= value.shape[dim]
        slab = aten.slice.Tensor(value, dim, index, index + 1)
        shape = view_shape(node_value(piece))
        declined = slice_resizes_at_runtime(value, slab, dim, index, index + 1)
        if declined is None and isinstance(shape, Declined):
            declined = shape
        if declined is not None:
            return declined
        shapes[index] = shape
    return SelectsAsSlices(node, dim, shapes)


def rewrite_selects_as_slices(match: SelectsAsSlices) -> None:
    node, graph = match.node, match.node.graph
    source = node.args[0]
    for index, piece in _selected(node).items():
        index %= node_value(source).shape[match.dim]
        with graph.inserting_before(piece):
            part = graph.call_function(aten.slice.Tensor, (source, match.dim, index, index + 1, 1))
            part.meta = {
                **node.meta,
                "val": aten.slice.Tensor(node_value(source), match.dim, index, index + 1),
            }
            view = graph.call_function(aten.view.default, (part, list(match.shapes[index])))
        view.meta = {**node.meta, "val": node_value(piece)}
        piece.replace_all_uses_with(view)
        graph.erase_node(piece)
    if node in graph.nodes:
        graph.erase_node(node)
    record_applied(FOLD, node.name, f"{len(match.shapes)} slabs along dim {match.dim} as views")


def _match_pieces(node: torch.fx.Node, dtypes: Collection[torch.dtype]):
    if node.op == "call_function" and node.target in SELECTS:
        return match_selects_as_slices(node, dtypes)
    return match_split_as_slices(node, dtypes)


def _rewrite_pieces(match: SplitAsSlices | SelectsAsSlices) -> None:
    if isinstance(match, SelectsAsSlices):
        rewrite_selects_as_slices(match)
    else:
        rewrite_as_slices(match)


def splits_as_slices(program: ExportedProgram, *, bf16: bool) -> ExportedProgram:
    """`program`, or a rewritten copy when some split, select or unbind becomes slices.

    `bf16`: whether XNNPACK compiles a slice in bf16 for this lowering."""
    match = functools.partial(_match_pieces, dtypes=delegated_floats(bf16))
    return rewrite_matches_on_a_copy(program, match, _rewrite_pieces, FOLD)
