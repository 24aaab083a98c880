# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.


"""Planning the XNNPACK weight fold: closures, groups and the growth budget.

    seed -> closure (every producer back to the placeholders, all foldable)
         -> groups (closures sharing a source or an op fold together or not at all)
         -> a group folds when the bytes it stores are at most those it erases,
            or within what is left of the program's growth budget, smallest growth first

From each seed an explicit stack walks back through constant-only producers; the
whole closure folds or the seed declines with the first reason found.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from etfold.backends.xnnpack.partition.weight_fold_seeds import (
    VALUE,
    Seed,
    find_constant_frontier,
    find_seeds,
    is_export_check,
    is_tensor_value,
    source_verdicts,
    weight_fold_op_verdict,
)
from etfold.decisions import Declined
from etfold.exir.passes.constant_prop.name import fold_expression
from etfold.exir.passes.constant_prop.verdicts import (
    EVERY_METHOD,
    agreed_custom,
    constant_sources,
    is_impure,
    source_custom,
)
from etfold.exir.passes.graph_walk import state_placeholders, written_arguments
from etfold.exir.passes.node_shapes import node_value
from etfold.exir.program.buffer_marks import BUFFER_FOLD_BLOCKERS

GROWTH_FLOOR_BYTES = 64 * 1024


@dataclass(frozen=True)
class Closure:
    """Everything a seed is computed from: ops to fold and the placeholders they read."""

    seed: Seed
    nodes: frozenset[torch.fx.Node]
    sources: frozenset[torch.fx.Node]


@dataclass(frozen=True)
class FoldGroup:
    """Closures sharing a source or an op; they fold together or not at all."""

    closures: tuple[Closure, ...]
    nodes: frozenset[torch.fx.Node]
    added_bytes: int
    erased_bytes: int
    reads_buffers: bool
    must_fold: tuple[str, ...] = ()  # ops no backend lowers: folded whatever the size


@dataclass(frozen=True)
class WeightFoldPlan:
    groups: tuple[FoldGroup, ...]
    declined: tuple[tuple[Seed, str], ...]
    growth: int = 0  # bytes the accepted growing groups add, net

    @property
    def nodes_to_fold(self) -> frozenset[torch.fx.Node]:
        return frozenset().union(*(g.nodes for g in self.groups))


def fits_size_budget(added_bytes: int, erased_bytes: int) -> bool:
    return added_bytes <= erased_bytes


def lowers_nowhere(node: torch.fx.Node) -> bool:
    """An ATen op outside the core opset that export neither decomposes nor inlines.

    Left in the graph it fails Edge verification, so no backend or portable
    kernel ever runs it: folding is the only way its program lowers.
    """
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False
    if torch.Tag.core in target.tags or target in _default_decompositions():
        return False
    return not torch._C._dispatch_has_kernel_for_dispatch_key(
        target.name(), "CompositeImplicitAutograd"
    )


@functools.cache
def _default_decompositions() -> frozenset:
    return frozenset(torch.export.default_decompositions())


def constant_closure(
    program: ExportedProgram,
    seed: Seed,
    source_verdict: Callable[[torch.fx.Node], Declined | None],
) -> Closure | Declined:
    """Walk back from the seed with an explicit stack; every producer must be constant-only."""
    nodes: set[torch.fx.Node] = set()
    sources: set[torch.fx.Node] = set()
    stack, seen = [seed.value], {seed.value}
    while stack:
        node = stack.pop()
        if node.op == "placeholder":
            verdict = source_verdict(node)
            if verdict is not None:
                return verdict
            sources.add(node)
            continue
        verdict = weight_fold_op_verdict(node)
        if verdict is not None:
            written = _written_source(node, source_verdict)
            return verdict if written is None else written
        nodes.add(node)
        for producer in node.all_input_nodes:
            if producer not in seen:
                seen.add(producer)
                stack.append(producer)
    agreed = agreed_custom(sorted(sources, key=lambda s: s.name), source_custom)
    if isinstance(agreed, Declined):
        return agreed
    return Closure(seed, frozenset(nodes), frozenset(sources))


def _written_source(node: torch.fx.Node, source_verdict) -> Declined | None:
    """An op writing a placeholder in place: its result is that state, judged as such."""
    for written in written_arguments(node):
        if written.op == "placeholder" and (verdict := source_verdict(written)) is not None:
            return verdict
    return None


def _value_bytes(node: torch.fx.Node) -> int | None:
    value = node_value(node)
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return None
    return sum(v.numel() * v.element_size() for v in values)


def _group_closures(closures: list[Closure]) -> list[list[Closure]]:
    """Union closures that share a source placeholder or an op (explicit, no recursion)."""
    parent = list(range(len(closures)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[torch.fx.Node, int] = {}
    for i, closure in enumerate(closures):
        for node in closure.nodes | closure.sources:
            if node in owner:
                parent[find(i)] = find(owner[node])
            else:
                owner[node] = i
    groups: dict[int, list[Closure]] = {}
    for i, closure in enumerate(closures):
        groups.setdefault(find(i), []).append(closure)
    return list(groups.values())


def _expression_key(node: torch.fx.Node, known: dict) -> str | torch.fx.Node:
    """Equal keys: the fold stores one tensor (constant_prop_pass names folds by expression)."""
    if not all(p in known for p in _placeholders_under(node)):
        return node
    return fold_expression(node, known)[0]


def _placeholders_under(node: torch.fx.Node) -> set[torch.fx.Node]:
    found, stack, seen = set(), [node], {node}
    while stack:
        current = stack.pop()
        if current.op == "placeholder":
            found.add(current)
        for producer in current.all_input_nodes:
            if producer not in seen:
                seen.add(producer)
                stack.append(producer)
    return found


def _has_effects(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    return node.target is torch.ops.higher_order.with_effects or is_impure(node)


def runtime_check_on(nodes: frozenset[torch.fx.Node]) -> torch.fx.Node | None:
    """An effectful op outside the group reading its values (`_linalg_check_errors` on
    `linalg_inv_ex`'s info): folding would skip a check the program runs."""
    for node in sorted(nodes, key=lambda n: n.name):
        for user in node.users:
            if user not in nodes and not is_export_check(user) and _has_effects(user):
                return user
    return None


def _read_outside(node: torch.fx.Node, inside: frozenset | set) -> bool:
    return any(u not in inside and not is_export_check(u) for u in node.users)


def _measure_group(closures: list[Closure], known: dict) -> FoldGroup | Declined:
    nodes = frozenset().union(*(c.nodes for c in closures))
    # a multi-output op folds with every projection, read by the seed or not
    nodes |= {u for n in nodes for u in n.users if u.target is operator.getitem}
    check = runtime_check_on(nodes)
    if check is not None:
        return Declined(f"`{check.name}` checks the folded values at runtime ({check.target})")
    sources = frozenset().union(*(c.sources for c in closures))
    # a non-tensor result read outside the fold stays an op, and so does what it reads
    kept = {n for n in nodes if not is_tensor_value(n) and _read_outside(n, nodes)}
    stack = list(kept)
    while stack:
        for producer in stack.pop().all_input_nodes:
            if producer in nodes and not is_tensor_value(producer) and producer not in kept:
                kept.add(producer)
                stack.append(producer)
    added, stored = 0, set()
    for node in sorted(nodes - kept, key=lambda n: n.name):
        if _read_outside(node, nodes - kept):
            size = _value_bytes(node)
            if size is None:
                return Declined(f"`{node.name}` has no known tensor size")
            key = _expression_key(node, known)
            if key not in stored:  # a parametrization read twice is computed twice, stored once
                stored.add(key)
                added += size
    erased = 0
    for source in sources:
        if not _read_outside(source, nodes - kept):
            erased += _value_bytes(source) or 0
    return FoldGroup(
        tuple(closures),
        frozenset(nodes),
        added,
        erased,
        reads_buffers=any(BUFFER_FOLD_BLOCKERS in s.meta for s in sources),
    )


def _unlowerable_ops(group: FoldGroup) -> tuple[str, ...]:
    return tuple(sorted({str(n.target) for n in group.nodes if lowers_nowhere(n)}))


def growth_budget(program: ExportedProgram) -> int:
    """Bytes all growing folds together may add: max(64 KiB, 1 % of the constant bytes)."""
    constant_bytes = sum(_value_bytes(node) or 0 for node in state_placeholders(program).values())
    return max(GROWTH_FLOOR_BYTES, constant_bytes // 100)


def _closures(program: ExportedProgram, seeds: list[Seed]):
    source_verdict = source_verdicts(program)
    closures: list[Closure] = []
    declined: list[tuple[Seed, str]] = []
    for seed in seeds:
        found = constant_closure(program, seed, source_verdict)
        if isinstance(found, Declined):
            declined.append((seed, found.reason))
        else:
            closures.append(found)
    # a GEMM inside another seed's weight expression (orthogonal's matmul) folds with it
    inner = frozenset().union(*(c.nodes for c in closures))
    closures = [c for c in closures if c.seed.position == VALUE or c.seed.gemm not in inner]
    declined = [(seed, reason) for seed, reason in declined if seed.gemm not in inner]
    return closures, declined


def _within_budget(growing: list[FoldGroup], budget: int):
    """Growing groups in order of least growth (largest net saving) until the budget is spent."""
    accepted: list[FoldGroup] = []
    declined: list[tuple[Seed, str]] = []
    for group in sorted(growing, key=lambda g: (g.added_bytes - g.erased_bytes, g.added_bytes)):
        growth = group.added_bytes - group.erased_bytes
        if growth <= budget:
            budget -= growth
            accepted.append(group)
            continue
        reason = (
            f"folding would grow the program by {growth} B (adds {group.added_bytes}, erases "
            f"{group.erased_bytes}), past the {budget} B left of the growth budget"
        )
        declined.extend((c.seed, reason) for c in group.closures)
    return accepted, declined


def plan_weight_folds(
    program: ExportedProgram, slots: dict, budget: int | None = None
) -> WeightFoldPlan:
    """Match: which constant-only subgraphs fold (grouped) and why the others stay ops.

    budget: bytes growing folds may add (default: `growth_budget(program)`).
    """
    gemm_seeds = find_seeds(program, slots)
    in_gemm_slots = {seed.value for seed in gemm_seeds}
    frontier = [s for s in find_constant_frontier(program) if s.value not in in_gemm_slots]
    seeds = gemm_seeds + frontier
    closures, declined = _closures(program, seeds)
    known = constant_sources(program, EVERY_METHOD)[0] if closures else {}
    groups: list[FoldGroup] = []
    growing: list[FoldGroup] = []
    for members in _group_closures(closures):
        group = _measure_group(members, known)
        if isinstance(group, Declined):
            declined.extend((c.seed, group.reason) for c in members)
        elif unlowerable := _unlowerable_ops(group):
            groups.append(dataclasses.replace(group, must_fold=unlowerable))
        elif fits_size_budget(group.added_bytes, group.erased_bytes):
            groups.append(group)
        else:
            growing.append(group)
    budget = growth_budget(program) if budget is None else budget
    accepted, over_budget = _within_budget(growing, budget)
    growth = sum(g.added_bytes - g.erased_bytes for g in accepted)
    return WeightFoldPlan(tuple(groups + accepted), tuple(declined + over_budget), growth)
