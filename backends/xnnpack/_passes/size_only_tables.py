# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Which values a program computes from its sizes alone, and each one's table.

    v = f(constants, s)   ->   T = v at the bounds, when v(s) = T[:s] at every s

A value is size-only when it reads no user input's values (sizes only), and has a
symbolic dim. The ones worth a table are those a user-value computation (or the
output) reads, each taken at the highest value that only shape ops separate from it.
Its table is checked bit for bit at every size the bounds allow (`mask_at_every_size`
owns the sizes and the budget). An attention reading a value as its mask gets the
float mask its decomposition adds instead (a boolean v: where(v, 0, -inf)), without
the leading 1s it broadcasts: a table worth having even for a mask only sliced from
a buffer, since it saves that conversion or the views to and from those 1s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from etfold.backends.xnnpack._passes.attention_mask_unexpanded_pass import MASK_AT, SDPA
from etfold.backends.xnnpack._passes.mask_at_every_size import (
    known_at_every_size,
    user_value_readers,
)
from etfold.decisions import Declined
from etfold.exir.passes.graph_walk import StateFacts, symbolic_axes, value_ancestors
from etfold.exir.passes.node_shapes import node_value

aten = torch.ops.aten

SHAPE_OPS = {
    aten.unsqueeze.default,
    aten.view.default,
    aten.reshape.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.alias.default,
}
# ops that move, view or slice a value: a value computed by these alone saves nothing
_MOVES = SHAPE_OPS | {aten.slice.Tensor, aten.expand.default, aten.sym_size.int}
CHECKS = {aten._assert_tensor_metadata.default}  # read a value's metadata, not the value


@dataclass(frozen=True)
class Table:
    """A value at the bounds, in the form its readers get; per symbolic dim, the name
    of a node giving its size; and the attentions reading it as their mask."""

    value: torch.Tensor
    lengths: tuple[tuple[int, str], ...]
    sizes: int  # the size assignments checked
    masking: tuple[str, ...] = ()


def _is_size_only(node: Node, reading_values: set[Node]) -> bool:
    value = node_value(node)
    return (
        node.op == "call_function"
        and node not in reading_values
        and isinstance(value, torch.Tensor)
        and bool(symbolic_axes(value))
    )


def _highest_shape_source(node: Node, reading_values: set[Node]) -> Node:
    """`node`, or the value it is shape ops of; an attention's mask as it reads it, since
    its table is the float mask, without the leading dims attention broadcasts."""
    if mask_readers(node):
        return node
    while node.target in SHAPE_OPS and _is_size_only(node.args[0], reading_values):
        node = node.args[0]
    return node


def tabled_values(program: ExportedProgram) -> list[Node]:
    """The size-only values a user-value computation or the output reads, each taken at
    its highest shape-op source, in graph order."""
    reading_values = user_value_readers(program)
    found: set[Node] = set()
    for node in program.graph.nodes:
        if not _is_size_only(node, reading_values):
            continue
        if any(u in reading_values or u.op == "output" for u in node.users):
            found.add(_highest_shape_source(node, reading_values))
    return [node for node in program.graph.nodes if node in found]


def _computes(node: Node) -> bool:
    return any(n.op == "call_function" and n.target not in _MOVES for n in value_ancestors(node))


def _length_nodes(node: Node) -> tuple[tuple[int, str], ...] | Declined:
    """(dim, a node before `node` giving its size) for each symbolic dim of `node`."""
    value, earlier = node_value(node), []
    for current in node.graph.nodes:
        if current is node:
            break
        earlier.append(current)
    lengths = []
    for dim in symbolic_axes(value):
        expr = value.shape[dim].node.expr
        giving = [
            n
            for n in earlier
            if isinstance(v := node_value(n), torch.SymInt) and v.node.expr == expr
        ]
        if not giving:
            return Declined(f"no node gives dim {dim} ({value.shape[dim]}) to slice to")
        lengths.append((dim, giving[0].name))
    return tuple(lengths)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _leading_block(value: torch.Tensor, table: torch.Tensor) -> bool:
    if value.dim() != table.dim():
        return False
    if any(v > t for v, t in zip(value.shape, table.shape, strict=True)):
        return False
    return _same_bits(value, table[tuple(slice(0, n) for n in value.shape)])


def mask_readers(node: Node) -> list[Node]:
    """The attentions reading `node` as their mask, when they are all its readers (but
    checks), share one query dtype, and the mask is boolean or of that dtype; else none."""
    readers = [u for u in node.users if u.target not in CHECKS]
    masking = [u for u in readers if u.target is SDPA and u.args[MASK_AT:][:1] == (node,)]
    dtypes = {node_value(u.args[0]).dtype for u in masking}
    if masking != readers or len(dtypes) != 1:
        return []
    return masking if node_value(node).dtype in (torch.bool, *dtypes) else []


def _leading_ones(value: torch.Tensor, lengths) -> int:
    """How many leading dims of size 1 an attention's mask drops (it broadcasts them):
    all but the last two, and none when a symbolic dim is among them."""
    ones = 0
    while ones < value.dim() - 2 and value.shape[ones] == 1:
        ones += 1
    return 0 if any(dim < ones for dim, _ in lengths) else ones


def additive_mask(table: Table, masking: list[Node]) -> Table:
    """The float mask attention adds for `table` in the query's dtype (a boolean one: 0
    kept, -inf masked; a float one as it is), without leading dims of size 1: attention
    broadcasts its mask, and XNNPACK views a tensor with one symbolic dim at most."""
    ones = _leading_ones(table.value, table.lengths)
    dtype = node_value(masking[0].args[0]).dtype
    value = table.value
    if value.dtype is torch.bool:
        value = torch.where(value, 0.0, -math.inf).to(dtype)
    lengths = tuple((dim - ones, length) for dim, length in table.lengths)
    names = tuple(a.name for a in masking)
    return Table(value.reshape(value.shape[ones:]), lengths, table.sizes, names)


def _worth_a_table(node: Node) -> bool:
    """A table saves ops: `node` is computed (not only moved and sliced), or attention
    reads it as a mask the table gives in its added form, converted or with fewer dims."""
    if _computes(node):
        return True
    if not mask_readers(node):
        return False
    value = node_value(node)
    return value.dtype is torch.bool or _leading_ones(value, _symbolic_lengths(value)) > 0


def _symbolic_lengths(value: torch.Tensor) -> tuple[tuple[int, str], ...]:
    return tuple((dim, "") for dim in symbolic_axes(value))


def judge_table(node: Node, program: ExportedProgram, facts: StateFacts) -> Table | Declined | None:
    """`node`'s table when `node` is its leading block at every size; why not; None when
    a table would save nothing (`node` is computed by moves and slices alone, and is no
    attention's mask whose table drops a conversion or leading dims)."""
    if not _worth_a_table(node):
        return None
    lengths = _length_nodes(node)
    if isinstance(lengths, Declined):
        return lengths
    found = known_at_every_size(program, node, facts)
    if isinstance(found, Declined):
        return found
    largest = max((value for _, value in found), key=lambda v: (v.numel(), tuple(v.shape)))
    for assignment, value in found:
        if not _leading_block(value, largest):
            at = ", ".join(f"{k} = {v}" for k, v in assignment.items())
            return Declined(f"`{node.name}` at {at} is not the leading block of its largest value")
    table = Table(largest, lengths, len(found))
    masking = mask_readers(node)
    return additive_mask(table, masking) if masking else table
