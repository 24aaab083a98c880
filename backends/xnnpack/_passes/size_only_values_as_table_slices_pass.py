# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Values computed from constants and the program's sizes alone, as slices of tables.

Given:   v_i = f_i(constants, s)    v_i: [1, .., s, w_i..], s symbolic; v_i reads no
                                    user input's values, only sizes
Result:  R = slice(P, 0, 0, s)      P = cat(v_i at the bounds, as [hi, w_i] rows), a
         v_i = view(slice(R, 1, o_i, o_i + w_i), [1, .., s, w_i..])     new constant

Exact when each v_i at every s the bounds allow is the leading block of its value at
the bounds: checked at each of them, bit for bit (`size_only_tables`). The values
whose first symbolic dim is one size share one table, so one slice of it runs per
call; the pieces are slices of whole rows and views, which XNNPACK runs on dynamic
shapes. A value [s, s2] (attention's mask, in the float form it adds) goes first in
its table: its second slice, to s2, stays outside too. Any other value gets its own
table, sliced along each symbolic dim.

Why: a dynamic export builds attention's causal mask and rotary embedding's cos/sin
from `arange(s)` on every call, on integer, boolean and trigonometric ops XNNPACK
does not take: a tiny HF Llama runs 30 of them outside its delegates, and turns its
mask into floats once per layer. A static export folds them into constants. As
slices, only the slices stay outside (XNNPACK's slice infers only whole dims).

Declines (`size_only_tables`): a value reading a buffer some method writes, over
the sizes or elements checked, not a leading block at some size, or with a size no
node of the program gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from etfold.backends.xnnpack._passes.attention_mask_unexpanded_pass import MASK_AT
from etfold.backends.xnnpack._passes.size_only_tables import Table, judge_table, tabled_values
from etfold.decisions import Declined, record_applied
from etfold.exir.passes.graph_walk import (
    add_lifted_constant,
    call_with_value,
    drop_unread,
    state_facts,
)
from etfold.exir.passes.node_rewrite_driver import rewrite_judged_on_a_copy
from etfold.exir.passes.node_shapes import argument_values, is_last_axis, node_value

FOLD = "xnnpack.size_only_values_as_table_slices"

aten = torch.ops.aten


@dataclass(frozen=True)
class Member:
    name: str
    table: Table
    rows: bool  # packed as [hi, w] rows of the shared table; else sliced on its own


@dataclass(frozen=True)
class Tables:
    """The verdict of a group's first value: every value of the group, in table order."""

    members: tuple[Member, ...]


@dataclass(frozen=True)
class TablesMatch:
    leader: Node  # the group's first value: the shared table is sliced before it
    tables: Tables


def _row_form(table: Table) -> str | None:
    """ "rows" when `table` packs as [hi, w] rows; "square" when it is [hi, hi2] (its
    second size sliced outside); None when it needs its own slices."""
    (first, _), *others = table.lengths
    value = table.value
    if any(size != 1 for size in value.shape[:first]):
        return None
    if not others:
        return "rows"
    if len(others) == 1 and is_last_axis(others[0][0], value.dim()) and others[0][0] == first + 1:
        return "square"
    return None


def group_tables(verdicts: dict[str, Table]) -> dict[str, Tables]:
    """Each group's verdict under its first value's name (`verdicts` in graph order): the
    values sharing their first size and dtype pack into one table, one [hi, hi2] value
    first; the rest alone."""
    groups: dict[tuple, list[Member]] = {}
    for name, table in verdicts.items():
        form = _row_form(table)
        key = (table.lengths[0][1], table.value.dtype)
        group = groups.get(key, [])
        if form is None or (form == "square" and group and _row_form(group[0].table) == "square"):
            groups[(name,)] = [Member(name, table, rows=False)]
            continue
        member = Member(name, table, rows=True)
        groups[key] = [member, *group] if form == "square" else [*group, member]
    order = list(verdicts)
    return {
        min((m.name for m in members), key=order.index): Tables(tuple(members))
        for members in groups.values()
    }


def _slice(graph, source: Node, dim: int, start: object, end: object) -> Node:
    value = aten.slice.Tensor(node_value(source), dim, start, argument_values(end))
    return call_with_value(graph, aten.slice.Tensor, (source, dim, start, end), value)


def with_spare(table: torch.Tensor, dims) -> torch.Tensor:
    """`table` one longer along each of `dims` (zeros, never read): no slice to a length
    then ends at the table's end, where torch's whole-dim fast path would guard the
    length below its bound (and `.module()` refuse the bound)."""
    for dim in dims:
        spare = list(table.shape)
        spare[dim] = 1
        table = torch.cat([table, table.new_zeros(spare)], dim)
    return table


def _own_slices(graph, constant: Node, table: Table, by_name: dict) -> Node:
    current = constant
    for dim, length in table.lengths:
        current = _slice(graph, current, dim, 0, by_name[length])
    return current


def _row_piece(graph, rows: Node, member: Member, offset: int, width: int, by_name) -> Node:
    """The member's value from the sliced rows: its columns, viewed to its shape (the
    shared table's spare column is never one of them)."""
    table = member.table
    if _row_form(table) == "square":
        return _slice(graph, rows, 1, 0, by_name[table.lengths[1][1]])
    piece = _slice(graph, rows, 1, offset, offset + width)
    shape = list(table.value.shape)
    ((dim, length),) = table.lengths
    shape[dim] = by_name[length]
    if len(shape) == 2:
        return piece
    return call_with_value(
        graph,
        aten.view.default,
        (piece, shape),
        aten.view.default(node_value(piece), argument_values(shape)),
    )


def _attach(node: Node, value: Node, table: Table) -> None:
    """`node`'s readers read `value` (an attention, as its mask)."""
    if table.masking:
        for attention in [u for u in node.users if u.name in table.masking]:
            attention.update_arg(MASK_AT, value)
        return
    value.meta = {**node.meta, "val": node_value(node)}
    node.replace_all_uses_with(value)


def rewrite_tables(match: TablesMatch, program: ExportedProgram) -> None:
    graph, members = match.leader.graph, match.tables.members
    by_name = {n.name: n for n in graph.nodes}
    packed = [m for m in members if m.rows]
    if packed:
        rows = [
            m.table.value.reshape(m.table.value.shape[m.table.lengths[0][0]], -1) for m in packed
        ]
        packed_rows = with_spare(torch.cat(rows, 1), (0, 1))
        constant = add_lifted_constant(program, f"{match.leader.name}_table", packed_rows)
        with graph.inserting_before(match.leader):
            sliced = _slice(graph, constant, 0, 0, by_name[packed[0].table.lengths[0][1]])
        offset = 0
        for member, row in zip(packed, rows, strict=True):
            node = by_name[member.name]
            with graph.inserting_before(node):
                piece = _row_piece(graph, sliced, member, offset, row.shape[1], by_name)
            _attach(node, piece, member.table)
            offset += row.shape[1]
    for member in (m for m in members if not m.rows):
        node = by_name[member.name]
        dims = [dim for dim, _ in member.table.lengths]
        spared = with_spare(member.table.value, dims)
        constant = add_lifted_constant(program, f"{node.name}_table", spared)
        with graph.inserting_before(node):
            piece = _own_slices(graph, constant, member.table, by_name)
        _attach(node, piece, member.table)
    drop_unread([by_name[member.name] for member in members])
    for member in members:
        shape = "x".join(map(str, member.table.value.shape))
        form = "its additive float mask" if member.table.masking else "itself"
        shared = (
            f", in one table with {len(packed)} values" if member.rows and len(packed) > 1 else ""
        )
        record_applied(
            FOLD,
            member.name,
            f"a {shape} table of {form}, sliced{shared}: its leading block at each of its "
            f"{member.table.sizes} sizes",
        )


def size_only_values_as_table_slices(program: ExportedProgram) -> ExportedProgram:
    """`program`, or a rewritten copy where values of the sizes alone are tables' slices."""
    facts = state_facts(program)
    verdicts: dict[str, Table | Declined] = {}
    for node in tabled_values(program):
        verdict = judge_table(node, program, facts)
        if verdict is not None:
            verdicts[node.name] = verdict
    declined = {name: v for name, v in verdicts.items() if isinstance(v, Declined)}
    leaders = group_tables({n: v for n, v in verdicts.items() if not isinstance(v, Declined)})
    copies: list[ExportedProgram] = []

    return rewrite_judged_on_a_copy(
        program,
        lambda node: leaders.get(node.name) or declined.get(node.name),
        TablesMatch,
        lambda found: rewrite_tables(found, copies[0]),
        FOLD,
        copies.append,
    )
