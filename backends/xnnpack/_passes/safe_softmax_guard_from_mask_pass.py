# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Attention's fully-masked-row guard, read from the mask, as a multiply.

Given:   x = s + M                          s a matmul's scores (finite), M a mask tensor
         y = where(logical_not(any(logical_not(eq(x, -inf)), d, keepdim)),
                   full_like(softmax(x, d), 0), softmax(x, d))
Result:  r = any(M != -inf, d', keepdim)    d' = d on M's dims (r = M != -inf when M
                                            broadcasts along d without holding it)
         y = softmax(s + where(r, M, 0), d) * float(r)

With s finite, an entry of x is -inf exactly where M is, so the guard's rows, those
whose every entry is -inf, are the rows where r is False. There `where(r, M, 0)` is
0 on the whole row, the softmax of a finite row is finite, and times 0.0 it is
+0.0, what the guard writes. Every other row adds M itself, and its softmax times
1.0 is itself: bit for bit. A NaN or +inf in M counts as kept in both forms, which
then give the same NaN.

Why. With a mask read at runtime (a padding mask, a user's boolean mask), no row
is known to keep an entry, so `safe_softmax_as_softmax` keeps the guard: six ops on
the scores' [B, H, T, T] outside the delegates, splitting each attention in two.
Here the row test runs on the mask's own shape ([1, 1, T, T], [T, T]: once per mask
node, shared by the layers reading it; when lowering, for a mask computed from
constants alone), and the guard becomes a multiply XNNPACK runs: the attention
stays one delegate. (`where(r, M, 0)` keeps M's dtype, so the add promotes as
before.)

It assumes what `safe_softmax_as_softmax` assumes: the scores are finite (finite q
and k whose products do not overflow), and so are their sums with the mask's finite
entries (a finfo.min mask plus a score beyond -1e31 in float32 would round to -inf
and count as masked for the guard, not here). Declines: a mask not a floating-point
tensor; scores read by more than the softmax and the guard; a guarded softmax the
program returns. Runs on the ATen program, before decomposition; a program holding
an SDPA (or a `_safe_softmax`) is decomposed with the lowering's own table first.
Runs after `safe_softmax_as_softmax`, which drops the guards no row needs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from etfold.backends.xnnpack._passes.decomposed_first import decomposed_for
from etfold.backends.xnnpack._passes.mask_at_every_size import known_at_every_size
from etfold.backends.xnnpack._passes.safe_softmax_as_softmax_pass import (
    WRITES_THE_GUARD,
    SoftmaxGuard,
    guarded_masks,
    not_returned,
    scores_and_mask,
    softmax_guard,
)
from etfold.decisions import Declined, first_declined, record_applied
from etfold.exir.passes.graph_walk import add_lifted_constant, state_facts
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import call_on_values, node_value

FOLD = "xnnpack.safe_softmax_guard_from_mask"

aten = torch.ops.aten


@dataclass(frozen=True)
class GuardFromMask:
    guard: SoftmaxGuard
    mask: Node
    mask_dim: int | None  # d on the mask's dims; None where the mask lacks it
    known: torch.Tensor | None  # the mask's value when it is a constant; else None


def float_mask(mask: Node) -> Declined | None:
    value = node_value(mask)
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        dtype = getattr(value, "dtype", type(value).__name__)
        return Declined(f"the mask `{mask.name}` ({dtype}) is no floating-point tensor")
    return None


def scores_read_by_softmax_and_guard(guard: SoftmaxGuard) -> Declined | None:
    x = guard.softmax.args[0]
    readers = set(x.users) - {guard.softmax, *guard.guard}
    if readers:
        names = ", ".join(sorted(r.name for r in readers))
        return Declined(f"the masked scores `{x.name}` are read by {names} too")
    return None


def constant_masks(program: ExportedProgram) -> dict[str, torch.Tensor]:
    """The value of each guarded softmax's mask computed from constants alone (no size,
    no user input), by name: its row test is then computed when lowering."""
    facts, found = state_facts(program), {}
    for mask in guarded_masks(program):
        values = known_at_every_size(program, mask, facts)
        if not isinstance(values, Declined) and len(values) == 1 and not values[0][0]:
            found[mask.name] = values[0][1]
    return found


def match_guard_from_mask(
    node: Node, constants: Mapping[str, torch.Tensor]
) -> GuardFromMask | Declined | None:
    """The rewrite of the guard anchored at `node`, why it stays, or None when `node`
    is no guard's where or its softmax reads no mask tensor. `constants`:
    `constant_masks` of the program."""
    guard = softmax_guard(node)
    if guard is None:
        return None
    x = guard.softmax.args[0]
    parts = scores_and_mask(x)
    if isinstance(parts, Declined):
        return parts
    _, mask = parts
    if not isinstance(mask, Node):
        return None  # no mask, or a number: `safe_softmax_as_softmax` decides those
    declined = first_declined(
        lambda: float_mask(mask),
        lambda: scores_read_by_softmax_and_guard(guard),
        lambda: not_returned(guard),
    )
    if declined is not None:
        return declined
    dim = guard.dim - (node_value(x).dim() - node_value(mask).dim())
    return GuardFromMask(guard, mask, dim if dim >= 0 else None, constants.get(mask.name))


def _call(graph, target, args: tuple, kwargs: dict | None = None) -> Node:
    return call_on_values(graph, target, args, kwargs)


@dataclass(frozen=True)
class RowsKept:
    masked: Node  # where(r, M, 0)
    scale: Node  # float(r), in the scores' dtype


def _constant(program: ExportedProgram, stem: str, value: torch.Tensor) -> Node:
    return add_lifted_constant(program, stem, value)


def _computed_when_lowering(match: GuardFromMask, program: ExportedProgram) -> RowsKept:
    """The same ops on the constant mask, run once now."""
    value, dtype = match.known, node_value(match.guard.softmax).dtype
    kept = value != -math.inf
    if match.mask_dim is not None:
        kept = kept.any(match.mask_dim, keepdim=True)
    masked = torch.where(kept, value, torch.zeros((), dtype=value.dtype))
    name = match.mask.name
    return RowsKept(
        _constant(program, f"{name}_rows_kept", masked),
        _constant(program, f"{name}_rows_kept_scale", kept.to(dtype)),
    )


def _computed_per_call(match: GuardFromMask, program: ExportedProgram) -> RowsKept:
    mask, dtype = match.mask, node_value(match.guard.softmax).dtype
    zero = _constant(program, f"{mask.name}_zero", torch.zeros((), dtype=node_value(mask).dtype))
    # before the first guard's scores (matches are rewritten in graph order), the mask
    # read once; later guards reading the same mask come after them
    x = match.guard.softmax.args[0]
    with x.graph.inserting_before(x):
        kept = _call(x.graph, aten.ne.Scalar, (mask, -math.inf))
        if match.mask_dim is not None:
            kept = _call(x.graph, aten.any.dim, (kept, match.mask_dim, True))
        masked = _call(x.graph, aten.where.self, (kept, mask, zero))
        scale = _call(x.graph, aten._to_copy.default, (kept,), {"dtype": dtype})
    return RowsKept(masked, scale)


def _rows_kept(match: GuardFromMask, program: ExportedProgram, shared: dict) -> RowsKept:
    """The row test's mask and scale, once per mask, dim and dtype (every layer reading
    one mask shares them): constants for a constant mask, else ops on it."""
    key = (match.mask.name, match.mask_dim, node_value(match.guard.softmax).dtype)
    if key not in shared:
        compute = _computed_per_call if match.known is None else _computed_when_lowering
        shared[key] = compute(match, program)
    return shared[key]


def rewrite_guard_from_mask(match: GuardFromMask, program: ExportedProgram, shared: dict) -> None:
    rows = _rows_kept(match, program, shared)
    softmax, (where, *guard) = match.guard.softmax, match.guard.guard
    x = softmax.args[0]
    x.replace_input_with(match.mask, rows.masked)
    with x.graph.inserting_after(softmax):
        scaled = _call(x.graph, aten.mul.Tensor, (softmax, rows.scale))
    where.replace_all_uses_with(scaled)
    for node in (where, *guard):
        if not node.users:
            node.graph.erase_node(node)
    record_applied(
        FOLD, where.name, f"rows kept read from `{match.mask.name}`; the guard is a multiply"
    )


def _writes_the_guard(node: Node) -> bool:
    return node.target in WRITES_THE_GUARD


def safe_softmax_guards_from_masks(
    program: ExportedProgram, decomposition_table: Mapping | None
) -> ExportedProgram:
    """`program`, or a rewritten copy (decomposed first where an SDPA or `_safe_softmax`
    writes the guard) where some guard reads its rows from the mask."""
    candidate = decomposed_for(program, decomposition_table, _writes_the_guard)
    copies: list[ExportedProgram] = []
    shared: dict = {}
    constants = constant_masks(candidate)
    rewritten = rewrite_matches_on_a_copy(
        candidate,
        lambda node: match_guard_from_mask(node, constants),
        lambda found: rewrite_guard_from_mask(found, copies[0], shared),
        FOLD,
        copies.append,
    )
    return program if rewritten is candidate else rewritten
