# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""An embedding of the positions 0..n-1 as the table's first n rows.

Given:   e = embedding(W, i)          i: [1, .., 1, n], n symbolic, computed from
                                      constants and the program's sizes; i = 0, 1, ..,
                                      n - 1 along its last dim at every size
Result:  e = view(slice(W, 0, 0, n), [1, .., 1, n, H])    n read by a size node the
                                                          program holds (else off i)

e[.., p, :] = W[i[.., p]] = W[p] for p < n: the first n rows of W, in order. i is
checked against `arange(n)` at every size the export's bounds allow, which is exact.

Why: absolute position embeddings look up 0..s-1, as BERT's `position_ids[:, :s]` (a
buffer of 0..max-1 sliced to the length) or GPT-2's `arange(s)`. A static export folds
the lookup into a constant; a dynamic one keeps the positions and a gather, which
XNNPACK has not. The table's slice still stays outside (XNNPACK's slice infers only whole
dims), but it is one contiguous copy, no lookup, and the view joins the delegate.
Only then is it rewritten: with n static, constant propagation folds the lookup.

Declines: i not known when lowering (a written buffer, a buffer not judged across
methods), i not 0..n-1 at some size, a table with fewer than n rows at some size.
Left alone: an embedding of the user's values (the token lookup), or of static
positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from etfold.backends.xnnpack._passes.mask_at_every_size import (
    known_at_every_size,
    reads_user_values,
)
from etfold.decisions import Declined, first_declined, record_applied
from etfold.exir.passes.graph_walk import (
    StateFacts,
    ancestors,
    drop_unread,
    size_bounds,
    sizes_known_equal,
    state_facts,
    symbolic_axes,
)
from etfold.exir.passes.node_rewrite_driver import rewrite_judged_on_a_copy
from etfold.exir.passes.node_shapes import axis_index, node_value

FOLD = "xnnpack.embedding_of_positions_as_table_slice"

aten = torch.ops.aten


@dataclass(frozen=True)
class PositionsAsSlice:
    node: Node  # e = embedding(W, i)
    length: Node  # a node giving n, or the indices (their last size gives it)


def _counts_from_zero(indices: Node, program: ExportedProgram, facts: StateFacts):
    found = known_at_every_size(program, indices, facts)
    if isinstance(found, Declined):
        return found
    for _, value in found:
        if not torch.equal(value.flatten(), torch.arange(value.numel(), dtype=value.dtype)):
            # no size named: a static program deciding alike gives the same reason
            return Declined(f"`{indices.name}` is not 0, 1, .., n - 1")
    return None


def _rows_enough(weight: Node, indices: Node) -> Declined | None:
    rows, n = node_value(weight).shape[0], node_value(indices).shape[-1]
    if type(rows) is not int or size_bounds(n)[1] > rows:
        return Declined(f"`{weight.name}` has fewer rows than {n} may reach")
    return None


def length_node(embedding: Node, indices: Node) -> Node | None:
    """A node before `embedding` giving n computed without `indices` (which then goes),
    or None: the rewrite reads n off `indices` itself."""
    n = node_value(indices).shape[-1]
    for node in embedding.graph.nodes:
        if node is embedding:
            break
        value = node_value(node)
        same = isinstance(value, torch.SymInt) and value.node.expr == n.node.expr
        if same and indices not in ancestors(node):
            return node
    return None


def judge_positions(
    node: Node, program: ExportedProgram, facts: StateFacts
) -> Node | Declined | None:
    """The node giving n when `node` looks up the positions 0..n-1; else why not; None
    for other nodes and lookups this leaves alone."""
    if node.op != "call_function" or node.target is not aten.embedding.default:
        return None
    weight, indices = node.args[0], node.args[1]
    value = node_value(indices)
    if value is None or reads_user_values(indices, program):
        return None
    if value.dim() < 1 or symbolic_axes(value) != (axis_index(-1, value.dim()),):
        return None  # static positions: constant propagation folds the lookup
    if not all(sizes_known_equal(size, 1) for size in value.shape[:-1]):
        return None
    declined = first_declined(
        lambda: _counts_from_zero(indices, program, facts),
        lambda: _rows_enough(weight, indices),
    )
    if declined is not None:
        return declined
    return length_node(node, indices) or indices


def match_positions(node: Node, length: Node) -> PositionsAsSlice:
    """`node`'s match on the copy, given the program's node giving n (`judge_positions`'
    verdict): the copy's node of that name."""
    (length,) = [n for n in node.graph.nodes if n.name == length.name]
    return PositionsAsSlice(node, length)  # the indices themselves when no size node gives n


def rewrite_positions(match: PositionsAsSlice) -> None:
    node, graph = match.node, match.node.graph
    weight, indices = node.args[0], node.args[1]
    table, n = node_value(weight), node_value(indices).shape[-1]
    with graph.inserting_before(node):
        length = match.length
        if length is indices:
            length = graph.call_function(aten.sym_size.int, (indices, -1))
            length.meta["val"] = n
        shape = [*([1] * (node_value(indices).dim() - 1)), length, table.shape[1]]
        rows = graph.call_function(aten.slice.Tensor, (weight, 0, 0, length))
        rows.meta["val"] = table[:n]
        view = graph.call_function(aten.view.default, (rows, shape))
    view.meta = {**node.meta, "val": node_value(node)}
    node.replace_all_uses_with(view)
    graph.erase_node(node)
    drop_unread([indices])
    record_applied(FOLD, node.name, f"the first {n} rows of `{weight.name}`")


def embeddings_of_positions_as_table_slices(program: ExportedProgram) -> ExportedProgram:
    """`program`, or a rewritten copy where some lookup of 0..n-1 is the table's slice."""
    facts = state_facts(program)
    return rewrite_judged_on_a_copy(
        program,
        lambda node: judge_positions(node, program, facts),
        match_positions,
        rewrite_positions,
        FOLD,
    )
