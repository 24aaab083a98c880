# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A boolean `&` whose one operand is True everywhere, as its other operand.

Given:   z = a & b                    bool; a computed from constants and the program's
                                      sizes, True at every size
Result:  z -> b                       when b has z's shape
         expand(z, S) -> expand(b, S) for each reader, else: every reader an expand
                                      whose -1 sizes keep a dim b and z share

True & b = b elementwise, so z is b broadcast to z's shape, and an expand of z to S
is an expand of b to S: b broadcasts to z, so each of its dims is 1 or z's, which
S then gives (a -1 keeps the input's own size, so there b's must be z's).

Why: a padding mask `&` a mask built True from the length (transformers' `sdpa_mask`
`&`s it with `q_idx >= 0` and a `new_ones`; a user with `ones(s, 1, dtype=bool)`): a
static export folds the True operand into a constant, a dynamic one keeps its ops
(`arange`, `add`, unsqueezes, `ge`), none of which XNNPACK runs. a is checked at every size the export's bounds allow (or once,
when it reads no size), which is exact.

Left alone: an `&` of two known values (constant propagation folds it, or the `&`
reading it drops it whole). Declines: a not known when lowering (it reads a user
input's values, a written buffer), a False somewhere at some size, the program
returning z, a reader of z other than an expand when b has not z's shape, an expand
keeping (-1) a size b has not. Runs on the ATen program, before decomposition.
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
    drop_unread,
    sizes_known_equal,
    state_facts,
)
from etfold.exir.passes.node_rewrite_driver import rewrite_judged_on_a_copy
from etfold.exir.passes.node_shapes import node_value, shapes_known_equal

FOLD = "xnnpack.and_all_true_as_other_operand"

aten = torch.ops.aten
ANDS = frozenset({aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default})


@dataclass(frozen=True)
class AllTrueOperand:
    node: Node  # z = a & b
    true_at: int  # a's position among z's arguments (read again when rewriting)


def _is_bool_and(node: Node) -> bool:
    if node.op != "call_function" or node.target not in ANDS:
        return False
    values = [node_value(node), *map(node_value, node.args[:2])]
    return all(isinstance(v, torch.Tensor) and v.dtype == torch.bool for v in values)


def all_true(node: Node, program: ExportedProgram, facts: StateFacts) -> Declined | None:
    found = known_at_every_size(program, node, facts)
    if isinstance(found, Declined):
        return found
    for _, value in found:
        if not bool(value.all()):
            # no size named: a static program deciding alike gives the same reason
            return Declined(f"`{node.name}` holds a False")
    return None


def _keeps_a_size_other_lacks(expand: Node, other: torch.Tensor, out: torch.Tensor) -> bool:
    sizes = list(expand.args[1])
    offset = len(sizes) - out.dim()
    for j, size in enumerate(sizes):
        if size != -1:
            continue
        at_out = j - offset
        at_other = at_out - (out.dim() - other.dim())
        theirs = other.shape[at_other] if at_other >= 0 else 1
        if at_out < 0 or not sizes_known_equal(theirs, out.shape[at_out]):
            return True
    return False


def readers_take_the_other(node: Node, other: Node) -> Declined | None:
    out, value = node_value(node), node_value(other)
    if any(reader.op == "output" for reader in node.users):
        return Declined("the program returns it: its output would become another value")
    if shapes_known_equal(value.shape, out.shape):
        return None
    for reader in node.users:
        if reader.target is not aten.expand.default or reader.args[0] is not node:
            return Declined(
                f"`{reader.name}` reads it, not an expand, and `{other.name}` has not its shape"
            )
        if _keeps_a_size_other_lacks(reader, value, out):
            return Declined(f"`{reader.name}` keeps (-1) a size `{other.name}` has not")
    return None


def judge_and(node: Node, program: ExportedProgram, facts: StateFacts) -> int | Declined | None:
    """Which operand of `node`, a boolean `&`, is True everywhere and may go; else why
    neither; None for any other node."""
    if not _is_bool_and(node):
        return None
    if not any(isinstance(a, Node) and reads_user_values(a, program) for a in node.args[:2]):
        return None  # a known value: constant propagation's, or a reader's to judge
    reasons = []
    for at in (0, 1):
        operand, other = node.args[at], node.args[1 - at]
        if not isinstance(operand, Node) or not isinstance(other, Node):
            return None
        declined = first_declined(
            lambda: all_true(operand, program, facts),  # noqa: B023 (called at once)
            lambda: readers_take_the_other(node, other),  # noqa: B023
        )
        if declined is None:
            return at
        reasons.append(declined.reason)
    return Declined("; ".join(reasons))


def rewrite_and(match: AllTrueOperand) -> None:
    node = match.node
    true, other = node.args[match.true_at], node.args[1 - match.true_at]
    if shapes_known_equal(node_value(other).shape, node_value(node).shape):
        node.replace_all_uses_with(other)
    else:
        for reader in list(node.users):
            reader.replace_input_with(node, other)
    node.graph.erase_node(node)
    drop_unread([true])
    record_applied(FOLD, node.name, f"`{true.name}` is True everywhere: `{other.name}` is read")


def ands_all_true_as_other_operand(program: ExportedProgram) -> ExportedProgram:
    """`program`, or a rewritten copy where some `&` with True gives its other operand."""
    facts = state_facts(program)
    return rewrite_judged_on_a_copy(
        program, lambda node: judge_and(node, program, facts), AllTrueOperand, rewrite_and, FOLD
    )
