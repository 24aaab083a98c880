# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Drop attention's fully-masked-row guard where no row can be fully masked.

Given:   o = _softmax(x, d)
         y = where(logical_not(any(logical_not(x == -inf), d, keepdim)), full_like(o, 0), o)
Result:  y -> o                 when no row of x along d is entirely -inf, that is
  (a) x = s                     s a matmul's scores (through shape and dtype copies and
                                finite scalings): nothing is masked;
  (b) x = s + m (either order)  m computed from constants only (a causal mask built from
                                arange/full/index/le/where, a constant buffer), and every
                                row of m, broadcast to x, keeps an entry above half the
                                dtype's lowest value;
  (c) as (b), m computed from constants and the program's sizes (`arange(ids.size(1))`,
      a dynamic export's mask): m is computed at every size the export's bounds allow
      (`mask_at_every_size`), and every row keeps an entry at each.

The guard only replaces rows whose every entry is -inf, so where there are none it
returns `o` unchanged: the rewrite is exact. It assumes the scores are not -inf
where the mask is finite, i.e. finite q and k whose products do not overflow; for
a row where they are, the stock program returns zeros and this one NaN. A mask
written with the dtype's lowest value instead of -inf counts as masked there
(below half of it): scores added to it may round to -inf.

Why. torch decomposes `scaled_dot_product_attention`'s softmax as `_safe_softmax`,
whose guard (eq, logical_not, any, logical_not, full_like, where) ExecuTorch 1.5.1's
XNNPACK partitioner takes none of: six portable ops and one more delegate per
attention layer of every HF decoder and encoder.

Declines (the guard stays): a mask read from a user input's values or from state not
known when lowering, a mask with a fully masked row (at some size), scores not from a
matmul, a mask over more sizes than `mask_at_every_size` checks, a guarded softmax
the program returns.

Runs on the ATen program, before decomposition; a program holding an SDPA (or a
`_safe_softmax`) is decomposed with the lowering's own table first, so the guard is
seen; nothing rewritten, it comes back as it was.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Node

from etfold.backends.xnnpack._passes.decomposed_first import decomposed_for
from etfold.backends.xnnpack._passes.mask_at_every_size import (
    reads_sizes_only,
    size_reads,
    values_at_every_size,
)
from etfold.decisions import Declined, record_applied
from etfold.exir.passes.constant_prop.evaluate import evaluate_selection
from etfold.exir.passes.constant_prop.select import select_folds
from etfold.exir.passes.constant_prop.verdicts import EVERY_METHOD, source_verdict
from etfold.exir.passes.graph_walk import (
    StateFacts,
    input_kinds,
    known_placeholder,
    placeholders,
    state_facts,
    value_ancestors,
)
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import axis_index, node_value, rank_of

FOLD = "xnnpack.safe_softmax_as_softmax"

aten = torch.ops.aten
# ops whose decomposition writes the guard
WRITES_THE_GUARD = frozenset(
    {aten.scaled_dot_product_attention.default, aten._safe_softmax.default}
)
MATMULS = frozenset({aten.bmm.default, aten.mm.default, aten.matmul.default})
# a finite tensor in, the same values (moved, viewed or converted) out
VALUE_CARRIERS = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.expand.default,
        aten.permute.default,
        aten.transpose.int,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.alias.default,
        aten.clone.default,
        aten._to_copy.default,
        aten.to.dtype,
    }
)
_MULTIPLY = frozenset({aten.mul.Scalar, aten.mul.Tensor})
_DIVIDE = frozenset({aten.div.Scalar, aten.div.Tensor})
# the guard below the where, each node reading the next: logical_not, any, logical_not, eq
_GUARD_CHAIN = (aten.logical_not.default, aten.any.dim, aten.logical_not.default, aten.eq.Scalar)


@dataclass(frozen=True)
class SoftmaxGuard:
    """`_safe_softmax`'s decomposition: the softmax, the reduced axis, and the guard's
    nodes in an order where each is read only by those before it."""

    softmax: Node
    dim: int
    guard: tuple[Node, ...]  # where, full_like, logical_not, any, logical_not, eq


@dataclass(frozen=True)
class SafeSoftmaxAsSoftmax:
    guard: SoftmaxGuard
    detail: str


def _call(value: object, target) -> bool:
    return isinstance(value, Node) and value.op == "call_function" and value.target is target


def _chain_below(rows: object) -> list[Node] | None:
    """logical_not(any(logical_not(eq(x, -inf)))) from its top, or None."""
    chain, value = [], rows
    for target in _GUARD_CHAIN:
        if not _call(value, target):
            return None
        chain.append(value)
        value = value.args[0]
    return chain


def softmax_guard(node: Node) -> SoftmaxGuard | None:
    """The guard anchored at `node`, its where; None when `node` is not one."""
    if not _call(node, aten.where.self) or len(node.args) != 3:
        return None
    rows, zeros, out = node.args
    if not _call(out, aten._softmax.default) or not _call(zeros, aten.full_like.default):
        return None
    chain = _chain_below(rows)
    x, rank = out.args[0], rank_of(out.args[0])
    if chain is None or zeros.args[:2] != (out, 0) or rank is None:
        return None
    reduced, eq = chain[1], chain[-1]
    if eq.args != (x, -math.inf) or reduced.args[2:] != (True,):
        return None
    if not isinstance(reduced.args[1], int):
        return None
    if axis_index(reduced.args[1], rank) != axis_index(out.args[1], rank):
        return None
    return SoftmaxGuard(out, axis_index(out.args[1], rank), (node, zeros, *chain))


def _finite_scaling(node: Node) -> bool:
    """A multiply by a finite number, or a divide by a finite nonzero one."""
    factor = node.args[1] if len(node.args) > 1 else None
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        return False
    if node.target in _MULTIPLY:
        return math.isfinite(factor)
    return node.target in _DIVIDE and math.isfinite(factor) and factor != 0


def matmul_behind(value: object) -> Node | None:
    """The matmul whose result `value` is, through value carriers and finite scalings."""
    while isinstance(value, Node) and value.op == "call_function":
        if value.target in MATMULS:
            return value
        if value.target not in VALUE_CARRIERS and not _finite_scaling(value):
            return None
        value = value.args[0]
    return None


def scores_and_mask(x: Node) -> tuple[Node, object] | Declined:
    """(the matmul, the mask added to its scores, None when there is none)."""
    if (matmul := matmul_behind(x)) is not None:
        return matmul, None
    if _call(x, aten.add.Tensor) and not x.kwargs:
        first, second = x.args[:2]
        for scores, mask in ((first, second), (second, first)):
            if (matmul := matmul_behind(scores)) is not None:
                return matmul, mask
    return Declined(f"the softmax reads {x.name}, neither a matmul's scores nor scores + a mask")


def known_when_lowering(
    program: ExportedProgram, cone: set[Node], facts: StateFacts
) -> Declined | None:
    """None when every placeholder in `cone` holds a value known before any call, in
    every method (a buffer the lowering did not judge across methods is not), or is a
    user input whose sizes alone `cone` reads."""
    kinds = input_kinds(program)
    for node in placeholders(program):
        if node not in cone:
            continue
        if kinds.get(node.name) == InputKind.USER_INPUT and reads_sizes_only(node, cone):
            continue
        if kinds.get(node.name) == InputKind.USER_INPUT:
            return Declined(
                f"the mask comes from user input {node.name}: a row may be fully masked at runtime"
            )
        verdict = source_verdict(program, node, EVERY_METHOD, facts)
        if isinstance(verdict, Declined):
            return Declined(f"the mask is not known when lowering: {verdict.reason}")
    return None


def guarded_masks(program: ExportedProgram) -> list[Node]:
    """Every guarded softmax's mask node, in graph order, once each."""
    masks: dict[Node, None] = {}
    for node in program.graph.nodes:
        guard = softmax_guard(node)
        parts = scores_and_mask(guard.softmax.args[0]) if guard is not None else None
        if isinstance(parts, tuple) and isinstance(parts[1], Node):
            masks[parts[1]] = None
    return list(masks)


MaskValues = tuple[tuple[str, torch.Tensor], ...]  # (where: "" or the sizes, value)


def _at_every_size(
    program: ExportedProgram, mask: Node, reads: set[Node], facts: StateFacts
) -> MaskValues | Declined:
    sources = {
        node: known_placeholder(program, node, facts=facts).tensor
        for node in reads
        if node.op == "placeholder" and not reads_sizes_only(node, reads)
    }
    found = values_at_every_size(mask, reads, sources)
    if isinstance(found, Declined):
        return found
    return tuple((f"at {_named(assignment)}", value) for assignment, value in found)


def _named(assignment: Mapping) -> str:
    return ", ".join(f"{symbol} = {size}" for symbol, size in assignment.items())


def mask_values(program: ExportedProgram) -> dict[str, MaskValues | Declined]:
    """Each guarded softmax's mask, by node name: its values (one when computed from
    constants, by constant propagation's select and evaluate, the program untouched;
    one per size when it reads the program's sizes too), or why they are not known
    when lowering."""
    masks = guarded_masks(program)
    if not masks:
        return {}
    facts = state_facts(program)
    found: dict[str, MaskValues | Declined] = {}
    cone: set[Node] = set()
    for mask in masks:
        reads = value_ancestors(mask)
        declined = known_when_lowering(program, reads, facts)
        if declined is not None:
            found[mask.name] = declined
        elif size_reads(reads):
            found[mask.name] = _at_every_size(program, mask, reads, facts)
        else:
            cone |= reads
    if not cone:
        return found
    wanted = [node for node in cone if node.op == "call_function"]
    values = evaluate_selection(select_folds(program, (), nodes_to_fold=wanted)).values
    for mask in masks:
        value = values.get(mask)
        if mask.name in found:
            continue
        if not isinstance(value, torch.Tensor):
            found[mask.name] = Declined(f"the mask {mask.name} could not be computed when lowering")
        else:
            found[mask.name] = (("", value),)
    return found


def every_row_keeps_an_entry(
    mask: torch.Tensor, rank: int, dim: int, dtype: torch.dtype
) -> Declined | None:
    """None when each row of `mask` along `dim`, broadcast to a shape of `rank` dims,
    holds an entry above half of `dtype`'s lowest value (a score added to it cannot
    reach -inf). Broadcasting repeats rows and entries, so the mask's own rows decide."""
    lifted = mask.reshape((1,) * (rank - mask.dim()) + tuple(mask.shape))
    kept = (lifted.double() > torch.finfo(dtype).min / 2).any(dim)
    masked = (~kept).nonzero()
    if len(masked):
        row = tuple(masked[0].tolist())
        return Declined(
            f"row {row} of the constant mask is fully masked: the guard's zeros are needed"
        )
    return None


def not_returned(guard: SoftmaxGuard) -> Declined | None:
    if any(user.op == "output" for user in guard.guard[0].users):
        return Declined("the program returns the guarded softmax: its output would be renamed")
    return None


def _mask_values(mask: object, masks: Mapping[str, MaskValues | Declined]):
    """The mask's values, or why they are not known; add.Tensor's other operand is a
    tensor or a number."""
    if isinstance(mask, Node):
        return masks.get(mask.name, Declined(f"the mask {mask.name} was not evaluated"))
    return (("", torch.tensor(float(mask))),)


def every_row_kept_everywhere(
    values: MaskValues, rank: int, dim: int, dtype: torch.dtype
) -> Declined | None:
    """`every_row_keeps_an_entry` at each of the mask's values; the first decline, its
    sizes named."""
    for where, value in values:
        declined = every_row_keeps_an_entry(value, rank, dim, dtype)
        if declined is not None:
            return Declined(f"{declined.reason} {where}".rstrip())
    return None


def match_safe_softmax(
    node: Node, masks: Mapping[str, MaskValues | Declined]
) -> SafeSoftmaxAsSoftmax | Declined | None:
    """The rewrite of the guard anchored at `node`, a reason it stays, or None when
    `node` is no guard's where. `masks`: `mask_values` of the program."""
    guard = softmax_guard(node)
    if guard is None:
        return None
    x = guard.softmax.args[0]
    parts = scores_and_mask(x)
    if isinstance(parts, Declined):
        return parts
    if (declined := not_returned(guard)) is not None:
        return declined
    matmul, mask = parts
    if mask is None:
        return SafeSoftmaxAsSoftmax(guard, f"no mask: the scores are {matmul.name}'s")
    values = _mask_values(mask, masks)
    if isinstance(values, Declined):
        return values
    value = node_value(x)
    declined = every_row_kept_everywhere(values, value.dim(), guard.dim, value.dtype)
    if declined is not None:
        return declined
    if len(values) == 1:
        return SafeSoftmaxAsSoftmax(
            guard, f"every row of the constant mask `{mask}` keeps an entry"
        )
    detail = f"every row of the mask `{mask}` keeps an entry at each of its {len(values)} sizes"
    return SafeSoftmaxAsSoftmax(guard, detail)


def rewrite_safe_softmax(match: SafeSoftmaxAsSoftmax) -> None:
    """The where's readers read the softmax; the guard's ops nothing else reads go."""
    where, *_ = match.guard.guard
    where.replace_all_uses_with(match.guard.softmax)
    for node in match.guard.guard:
        if not node.users:
            node.graph.erase_node(node)
    record_applied(FOLD, where.name, match.detail)


def _writes_the_guard(node: Node) -> bool:
    return node.target in WRITES_THE_GUARD


def safe_softmaxes_as_softmax(
    program: ExportedProgram, decomposition_table: Mapping | None
) -> ExportedProgram:
    """`program`, or a rewritten copy (decomposed first where an SDPA or `_safe_softmax`
    writes the guard) when some guard is dropped."""
    candidate = decomposed_for(program, decomposition_table, _writes_the_guard)
    match = functools.partial(match_safe_softmax, masks=mask_values(candidate))
    rewritten = rewrite_matches_on_a_copy(candidate, match, rewrite_safe_softmax, FOLD)
    return program if rewritten is candidate else rewritten
