# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""An embedding whose indices are one value at every size, as that row, broadcast.

Given:   e = embedding(W, i)          i computed from constants and the program's
                                      sizes; every element v, at every size
         r = op(e, o) or op(o, e)     op: add, sub, mul; o of e's shape; for each reader
Result:  r = op(c, o) or op(o, c)     c = W[v] viewed [1, .., 1, H] (rank of e), a new
                                      constant named from W and v

e[p] = W[i[p]] = W[v] for every position p, and each reader broadcasts c to e's shape
(o has it), so it reads the same values. Each element of i is checked against v at
every size the export's bounds allow (or once, when it reads no size), which is exact.

Why: token types are one index at every length however they are written: BERT-like
embeddings (transformers' `BertEmbeddings`) read a buffer of zeros, `token_type_ids[:,
:s]` expanded; a user writes `zeros_like(ids)` or `ids.new_zeros(...)`, fills that read
the ids' shape alone (`graph_walk.value_inputs`). A dynamic export keeps the slice or
fill, a gather and the embedding, which XNNPACK has not, outside the delegate; the row
joins the add.

Left alone: an embedding of a user input's values (the token lookup). Declines: W or
i not known when lowering (a written buffer, a buffer not judged across methods),
i holding two values at some size (or a value W has no row for), a reader other than
an add, sub or mul with the other operand of e's shape. Runs on the ATen program,
before decomposition.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from etfold.backends.xnnpack._passes.mask_at_every_size import (
    known_at_every_size,
    reads_user_values,
)
from etfold.decisions import Declined, first_declined, record_declined
from etfold.exir.passes.graph_walk import (
    StateFacts,
    add_lifted_constant,
    constant_holding,
    drop_unread,
    state_facts,
)
from etfold.exir.passes.node_rewrite_driver import rewrite_each_match
from etfold.exir.passes.node_shapes import node_value, shapes_known_equal
from etfold.exir.program.working_copy import copy_for_rewrite

FOLD = "xnnpack.embedding_of_one_index_as_row"

aten = torch.ops.aten
BROADCASTING_READERS = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor})


@dataclass(frozen=True)
class Row:
    """What the embedding reads: row `index` of `weight`, viewed to `shape`."""

    weight: str  # the weight's placeholder name
    index: int
    value: torch.Tensor  # the row, viewed to the embedding's rank

    @property
    def name(self) -> str:
        return f"_etfold_{self.weight}_row_{self.index}"


@dataclass(frozen=True)
class EmbeddingAsRow:
    node: Node
    row: Row


def readers_broadcast_a_row(node: Node) -> Declined | None:
    shape = node_value(node).shape
    for reader in node.users:
        operands = reader.args[:2]
        others = [o for o in operands if o is not node]
        if (
            reader.target not in BROADCASTING_READERS
            or len(others) != 1
            or not shapes_known_equal(getattr(node_value(others[0]), "shape", ()), shape)
        ):
            return Declined(
                f"`{reader.name}` reads it, not an add, sub or mul with an operand of its shape"
            )
    return None


def _one_value(node: Node, program: ExportedProgram, facts: StateFacts) -> int | Declined:
    found = known_at_every_size(program, node, facts)
    if isinstance(found, Declined):
        return found
    first = int(found[0][1].flatten()[0]) if found[0][1].numel() else None
    for _, value in found:
        if first is None or not bool((value == first).all()):
            # no size named: a static program deciding alike gives the same reason
            return Declined(f"`{node.name}` holds more than one value")
    return first


def _weight(node: Node, program: ExportedProgram, facts: StateFacts) -> torch.Tensor | Declined:
    found = known_at_every_size(program, node, facts)
    return found if isinstance(found, Declined) else found[0][1]


def judge_embedding(
    node: Node, program: ExportedProgram, facts: StateFacts
) -> Row | Declined | None:
    """The row `node` (an embedding) reads everywhere, else why not; None for other nodes."""
    if node.op != "call_function" or node.target is not aten.embedding.default:
        return None
    weight, indices = node.args[0], node.args[1]
    if reads_user_values(indices, program):
        return None  # a lookup of the user's tokens: nothing to decline
    declined = first_declined(lambda: readers_broadcast_a_row(node))
    if declined is not None:
        return declined
    index = _one_value(indices, program, facts)
    if isinstance(index, Declined):
        return index
    table = _weight(weight, program, facts)
    if isinstance(table, Declined):
        return table
    if not 0 <= index < table.shape[0]:
        return Declined(f"`{indices.name}` holds {index}, not a row of `{weight.name}`")
    shape = (1,) * (node_value(node).dim() - 1) + (table.shape[1],)
    return Row(weight.name, index, table[index].detach().reshape(shape).clone())


def match_embedding(node: Node, judged: dict[str, Row | Declined]) -> EmbeddingAsRow | None:
    """`node`'s match, from the verdicts `judge_embedding` gave the program by name (the
    rewrite runs on a copy, whose nodes keep their names); declines were recorded there."""
    verdict = judged.get(node.name) if node.target is aten.embedding.default else None
    return EmbeddingAsRow(node, verdict) if isinstance(verdict, Row) else None


def rewrite_embedding(match: EmbeddingAsRow, program: ExportedProgram) -> str:
    node, row = match.node, match.row
    constant = constant_holding(program, row.name, row.value)  # embeddings of one row share it
    if constant is None:
        constant = add_lifted_constant(program, row.name, row.value)
    indices = node.args[1]
    node.replace_all_uses_with(constant)
    node.graph.erase_node(node)
    drop_unread([indices])
    return f"row {row.index} of `{row.weight}`, broadcast by its readers"


def embeddings_of_one_index_as_rows(program: ExportedProgram) -> ExportedProgram:
    """`program`, or a rewritten copy where some embedding reads one row everywhere."""
    facts = state_facts(program)
    judged = {
        node.name: verdict
        for node in program.graph.nodes
        if (verdict := judge_embedding(node, program, facts)) is not None
    }
    for name, verdict in judged.items():
        if isinstance(verdict, Declined):
            record_declined(FOLD, name, verdict.reason)
    if not any(isinstance(verdict, Row) for verdict in judged.values()):
        return program
    program = copy_for_rewrite(program)
    rewrite_each_match(
        list(program.graph.nodes),
        functools.partial(match_embedding, judged=judged),
        functools.partial(rewrite_embedding, program=program),
        FOLD,
    )
    program.graph_module.recompile()
    return program
