# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""An index that reads each element of its input once, in order, as a view.

Given:   y = index(x, [i_0, .., i_{k-1}])    k = rank of x; each i_d computed from
                                             constants and the program's sizes
         y.shape = x.shape with 1s inserted, dim d of x at axis a_d of y
         i_d, broadcast to y, = the coordinate along a_d    at every size
Result:  y = view(x, y.shape)                a symbolic size read as sym_size(x, d)

y[p] = x[i_0[p], .., i_{k-1}[p]] = x[p[a_0], .., p[a_{k-1}]], and with the a_d
ascending and every other axis of y of size 1, that is x's element at the same
place in row-major order: a view. Each i_d is checked against `arange(x.shape[d])`
along a_d at every size the export's bounds allow (or once, when it reads no
size), which is exact.

Why: a grid of aranges is how vmapped code reads every element: transformers' masks
(`sdpa_mask`, its vmapped mask functions) read a [b, s] padding mask as
`mask[arange(b)[:, None, None, None], arange(s)[None, None, None, :]]`, a user's
`x[arange(b)[:, None], arange(s)]` alike. Constant propagation folds those index tensors on a static export; on a
dynamic one each is an `arange(s)` chain of five ops. Either way the index, a
gather XNNPACK has not, stays outside the delegates with them; the view and its
size reads are all that remain.

Declines: an index with fewer index tensors than x has dims (or a None among
them), y not x's shape with 1s inserted, x not known contiguous, an index tensor
not known when lowering (it reads a user input's values, a written buffer) or
not its coordinate at some size. Runs on the ATen program, before decomposition.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
from torch.export import ExportedProgram
from torch.fx import Node

from etfold.backends.xnnpack._passes.mask_at_every_size import known_at_every_size
from etfold.decisions import Declined, first_declined, record_applied
from etfold.exir.passes.graph_walk import (
    StateFacts,
    drop_unread,
    known_contiguous,
    sizes_known_equal,
    state_facts,
)
from etfold.exir.passes.node_rewrite_driver import rewrite_judged_on_a_copy
from etfold.exir.passes.node_shapes import node_value

FOLD = "xnnpack.index_by_aranges_as_view"

aten = torch.ops.aten


@dataclass(frozen=True)
class IndexAsView:
    index: Node
    source: Node
    axes: tuple[int, ...]  # axes[d]: the axis of the output that dim d of the source is


def inserted_axes(source: tuple, out: tuple) -> tuple[int, ...] | None:
    """The axis of `out` each dim of `source` is when `out` is `source`'s shape with 1s
    inserted (the first such placing), else None."""
    axes, d = [], 0
    for axis, size in enumerate(out):
        if d < len(source) and sizes_known_equal(size, source[d]):
            axes.append(axis)
            d += 1
        elif not sizes_known_equal(size, 1):
            return None
    return tuple(axes) if d == len(source) else None


def indexes_every_dim(node: Node) -> Declined | None:
    source, indices = node.args[0], node.args[1]
    if any(not isinstance(i, Node) for i in indices) or len(indices) != node_value(source).dim():
        return Declined(
            f"indexes {sum(isinstance(i, Node) for i in indices)} of the "
            f"{node_value(source).dim()} dims of `{source.name}` by tensors"
        )
    return None


def ones_inserted(node: Node) -> Declined | None:
    source, out = node_value(node.args[0]), node_value(node)
    if inserted_axes(tuple(source.shape), tuple(out.shape)) is None:
        return Declined(
            f"the output's shape {list(out.shape)} is not {list(source.shape)} with 1s inserted"
        )
    return None


def contiguous_source(node: Node) -> Declined | None:
    if not known_contiguous(node_value(node.args[0])):
        return Declined(f"`{node.args[0].name}` is not known contiguous: a view cannot read it")
    return None


def _size_at(size: object, assignment: dict) -> int | None:
    if type(size) is int:
        return size
    expr = sympy.sympify(size.node.expr.xreplace(assignment))
    return int(expr) if expr.is_number else None


def _coordinate(value: torch.Tensor, length: int, axis: int, rank: int) -> bool:
    """`value`, broadcast against the output (of `rank` dims), is the coordinate along
    `axis`, of `length` values."""
    shape = [1] * rank
    shape[axis] = length
    expected = torch.arange(length).view(shape)
    lifted = value.reshape((1,) * (rank - value.dim()) + tuple(value.shape))
    try:
        got, want = torch.broadcast_tensors(lifted, expected)
    except RuntimeError:
        return False
    return bool(torch.equal(got, want))


def each_index_its_coordinate(
    node: Node, program: ExportedProgram, facts: StateFacts
) -> Declined | None:
    source, indices = node.args[0], node.args[1]
    shape, rank = node_value(source).shape, node_value(node).dim()
    axes = inserted_axes(tuple(shape), tuple(node_value(node).shape))
    for d, index in enumerate(indices):
        found = known_at_every_size(program, index, facts)
        if isinstance(found, Declined):
            return found
        for assignment, value in found:
            length = _size_at(shape[d], assignment)
            if length is None or not _coordinate(value, length, axes[d], rank):
                # no size named: a static program deciding alike gives the same reason
                return Declined(
                    f"`{index.name}` is not the coordinate of dim {d} of `{source.name}`"
                )
    return None


def judge_index(
    node: Node, program: ExportedProgram, facts: StateFacts
) -> tuple[int, ...] | Declined | None:
    """The axes of the output each dim of the source is, when `node` (an index) reads
    its source as a view; else why not; None for any other node."""
    if node.op != "call_function" or node.target is not aten.index.Tensor:
        return None
    declined = first_declined(
        lambda: indexes_every_dim(node),
        lambda: ones_inserted(node),
        lambda: contiguous_source(node),
        lambda: each_index_its_coordinate(node, program, facts),
    )
    if declined is not None:
        return declined
    return inserted_axes(tuple(node_value(node.args[0]).shape), tuple(node_value(node).shape))


def match_index_as_view(node: Node, axes: tuple[int, ...]) -> IndexAsView:
    return IndexAsView(node, node.args[0], axes)


def rewrite_index_as_view(match: IndexAsView) -> None:
    graph, index, source = match.index.graph, match.index, match.source
    shape = node_value(source).shape
    sizes: list[object] = []
    with graph.inserting_before(index):
        for axis, size in enumerate(node_value(index).shape):
            if type(size) is int:
                sizes.append(size)
                continue
            dim = match.axes.index(axis)
            read = graph.call_function(aten.sym_size.int, (source, dim))
            read.meta["val"] = shape[dim]
            sizes.append(read)
        view = graph.call_function(aten.view.default, (source, sizes))
    view.meta = {**index.meta, "val": node_value(source).view(node_value(index).shape)}
    indices = list(index.args[1])
    index.replace_all_uses_with(view)
    graph.erase_node(index)
    drop_unread(indices)
    record_applied(
        FOLD, index.name, f"reads `{source.name}` as a view of {list(node_value(view).shape)}"
    )


def index_by_aranges_as_view(program: ExportedProgram) -> ExportedProgram:
    """`program`, or a rewritten copy where some index reads its input as a view."""
    facts = state_facts(program)
    return rewrite_judged_on_a_copy(
        program,
        lambda node: judge_index(node, program, facts),
        match_index_as_view,
        rewrite_index_as_view,
        FOLD,
    )
