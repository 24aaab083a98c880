# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Fold parameter-only GEMM weight subgraphs so XNNPACK sees static weights.

    gemm(x, f(p1, …, pn), g(q1, …))      p, q parameters / proven-safe buffers / lifted constants
      -> gemm(x, W', b')                  W' = f(p1, …, pn), b' = g(q1, …) computed once at export

XNNPACK's GEMM configs (linear, convolution, addmm, mm) take a weight only when
it is a static parameter. weight_norm, spectral_norm and every other
`torch.nn.utils.parametrize` parametrization compute the weight in the graph,
so stock ExecuTorch runs those convs and linears on portable kernels.

Seeds are only the weight and bias arguments of the ops the enabled GEMM
configs partition; a parameter-only expression anywhere else stays an op. From
each seed an explicit stack walks back through constant-only producers; the
whole closure folds or the seed declines with the first reason found. Closures
that share a source are one group, applied only when the tensors it
materializes take no more bytes than the sources it erases.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from executorch.backends.xnnpack.partition.config.gemm_configs import (
    AddmmConfig,
    ConvolutionConfig,
    LinearConfig,
    MMConfig,
)
from executorch.backends.xnnpack.partition.config.xnnpack_config import ConfigPrecisionType
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from etfold.decisions import Declined, record_applied, record_declined
from etfold.exir.passes.constant_prop_pass import (
    allocates_memory,
    constant_prop_pass,
    fold_expression,
    is_impure,
    is_nondeterministic,
    is_quant_primitive,
)
from etfold.exir.passes.graph_walk import constant_sources, input_kinds, insert_to_copy
from etfold.exir.passes.inline_autocast_regions_pass import is_training_program
from etfold.exir.program.buffer_marks import BUFFER_FOLD_BLOCKERS, state_writes
from etfold.exir.program.method_marks import SHARED_ACROSS_METHODS
from etfold.exir.program.working_copy import copy_for_rewrite

FOLD = "xnnpack.fold_gemm_weight"
GROWTH_FLOOR_BYTES = 64 * 1024
# placeholder meta the fold reads; a retrace may drop it ("custom" holds external-file tags)
_CARRIED_MARKS = (SHARED_ACROSS_METHODS, BUFFER_FOLD_BLOCKERS, "custom")

aten = torch.ops.aten


@dataclass(frozen=True)
class GemmSlots:
    """Where a GEMM op takes its weight and bias (bias None: the op has none)."""

    weight: int
    bias: int | None
    weight_rank: int | None = None  # only seed when the weight has this rank


_CONV_OPS = (
    aten.conv1d,
    aten.conv2d,
    aten.conv3d,
    aten.conv_transpose1d,
    aten.conv_transpose2d,
    aten.conv_transpose3d,
    aten.convolution,
    aten._convolution,
)

# pre-decomposition ATen ops that decompose to what each upstream GEMM config partitions
_SLOTS_BY_CONFIG: dict[type, dict[torch._ops.OpOverloadPacket, GemmSlots]] = {
    LinearConfig: {aten.linear: GemmSlots(1, 2)},
    ConvolutionConfig: {op: GemmSlots(1, 2) for op in _CONV_OPS},
    AddmmConfig: {aten.addmm: GemmSlots(2, 0)},
    MMConfig: {aten.mm: GemmSlots(1, None), aten.matmul: GemmSlots(1, None, weight_rank=2)},
}

_STATE_KINDS = {
    InputKind.PARAMETER: "parameter",
    InputKind.BUFFER: "buffer",
    InputKind.CONSTANT_TENSOR: "constant",
}


def seed_slots(configs: Iterable) -> dict[torch._ops.OpOverloadPacket, GemmSlots]:
    """GEMM ops whose weights are worth folding under these partitioner configs.

    A config counts when it partitions fp32 and requires static fp32 weights
    (`force_non_static_weights_for_f32_linear` asks for the weight to stay an input).
    """
    slots: dict[torch._ops.OpOverloadPacket, GemmSlots] = {}
    for config in configs:
        for config_type, ops in _SLOTS_BY_CONFIG.items():
            if type(config) is not config_type:
                continue
            if ConfigPrecisionType.FP32 not in config.enabled_precision_types:
                continue
            if (
                config_type is not ConvolutionConfig
                and config.force_non_static_weights_for_f32_linear
            ):
                continue
            slots.update(ops)
    return slots


VALUE = "value"  # a seed that is a constant-only tensor read by a runtime op, not a GEMM slot


@dataclass(frozen=True)
class Seed:
    gemm: torch.fx.Node  # for a VALUE seed, the seed node itself
    position: str  # "weight", "bias" or VALUE
    value: torch.fx.Node

    @property
    def where(self) -> str:
        return f"{self.gemm.name}.{self.position}"


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


# ---------------------------------------------------------------- predicates


def is_static_state(program: ExportedProgram, node: torch.fx.Node) -> bool:
    return node.op == "placeholder" and _state_kind(program, node) is not None


# fill factories (full, ones_like, ...), quantization primitives (quantized_decomposed, torchao),
# allocations, impure and nondeterministic ops: the predicates etfold's constant_prop_pass declines on


def is_mutating(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def is_known_pure_target(node: torch.fx.Node) -> bool:
    """OpOverloads (judged by their schema elsewhere) and Python's `operator` builtins."""
    target = node.target
    return (
        isinstance(target, torch._ops.OpOverload)
        or getattr(target, "__module__", None) == "_operator"
    )


def is_shared_across_methods(node: torch.fx.Node) -> bool:
    return bool(node.meta.get(SHARED_ACROSS_METHODS, False))


def buffer_blockers(node: torch.fx.Node) -> tuple[str, ...] | None:
    """Reasons another method forbids folding this buffer; None when never judged."""
    return node.meta.get(BUFFER_FOLD_BLOCKERS)


def custom_meta_agrees(sources: Iterable[torch.fx.Node]) -> bool:
    customs = [s.meta.get("custom") or {} for s in sources]
    return all(c == customs[0] for c in customs[1:])


def fits_size_budget(added_bytes: int, erased_bytes: int) -> bool:
    return added_bytes <= erased_bytes


_EXPORT_CHECKS = frozenset({aten._assert_tensor_metadata.default, aten._assert_scalar.default})


def is_export_check(node: torch.fx.Node) -> bool:
    """An assertion export left on a value's metadata: decided once the value is a constant."""
    return node.op == "call_function" and node.target in _EXPORT_CHECKS


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


# ---------------------------------------------------------------- match


def _packet(node: torch.fx.Node):
    target = node.target
    return target.overloadpacket if isinstance(target, torch._ops.OpOverload) else None


def _state_kind(program: ExportedProgram, node: torch.fx.Node) -> str | None:
    kind = input_kinds(program).get(node.name)
    return _STATE_KINDS.get(kind) if kind is not None else None


def _rank(node: torch.fx.Node) -> int | None:
    value = node.meta.get("val")
    return value.dim() if isinstance(value, torch.Tensor) else None


def find_seeds(program: ExportedProgram, slots: dict) -> list[Seed]:
    """Weight and bias arguments of seedable GEMM ops that are not already static state."""
    seeds: list[Seed] = []
    for node in program.graph.nodes:
        if node.op != "call_function" or _packet(node) not in slots:
            continue
        slot = slots[_packet(node)]
        for position, index in (("weight", slot.weight), ("bias", slot.bias)):
            if (
                index is None
                or index >= len(node.args)
                or not isinstance(node.args[index], torch.fx.Node)
            ):
                continue
            value = node.args[index]
            if (
                position == "weight"
                and slot.weight_rank is not None
                and _rank(value) != slot.weight_rank
            ):
                continue
            if not is_static_state(program, value):
                seeds.append(Seed(node, position, value))
    return seeds


def source_verdicts(program: ExportedProgram) -> Callable[[torch.fx.Node], Declined | None]:
    """Whether a placeholder may be folded from, judged once per program's writes."""
    written = state_writes(program)
    fqn_of = {
        spec.arg.name: spec.target for spec in program.graph_signature.input_specs if spec.target
    }
    return lambda node: _source_verdict(program, node, written, fqn_of)


def constant_only_nodes(program: ExportedProgram) -> set[torch.fx.Node]:
    """Forward scan: nodes computed from foldable static state and literals alone."""
    source_verdict = source_verdicts(program)
    constant: set[torch.fx.Node] = set()
    for node in program.graph.nodes:
        if node.op == "placeholder":
            if source_verdict(node) is None:
                constant.add(node)
        elif _op_verdict(node) is None and all(p in constant for p in node.all_input_nodes):
            constant.add(node)
    return constant


def find_constant_frontier(program: ExportedProgram) -> list[Seed]:
    """Constant-only tensors that something computed from user input reads.

    Each is the root of a subgraph that would otherwise run on every call:
    casts of parameters, `1 + weight`, rotary tables, masks from literals.
    """
    constant = constant_only_nodes(program)
    return [
        Seed(node, VALUE, node)
        for node in program.graph.nodes
        if node in constant
        and node.op == "call_function"
        and _is_tensor_value(node)
        and any(u not in constant and not is_export_check(u) for u in node.users)
    ]


def _source_verdict(
    program: ExportedProgram,
    node: torch.fx.Node,
    written: dict[str, list[str]],
    fqn_of: dict[str, str],
) -> Declined | None:
    kind = _state_kind(program, node)
    if kind is None:
        return Declined(f"computed from user input `{node.name}`")
    fqn = fqn_of[node.name]
    if is_shared_across_methods(node):
        return Declined(f"`{fqn}` is read by several methods")
    if fqn in written:
        return Declined(
            f"`{fqn}` is written in this method ({', '.join(sorted(set(written[fqn])))})"
        )
    if kind == "buffer":
        blockers = buffer_blockers(node)
        if blockers is None:
            return Declined(
                f"buffer `{fqn}` was not judged across methods (lower through "
                "etfold.exir.to_edge_transform_and_lower to fold buffers)"
            )
        if blockers:
            return Declined(f"buffer `{fqn}`: {'; '.join(blockers)}")
    return None


def _op_verdict(node: torch.fx.Node) -> Declined | None:
    if node.op != "call_function":
        return Declined(f"`{node.name}` is a {node.op} node")
    if not is_known_pure_target(node):
        return Declined(f"`{node.name}` calls {node.target}, which is not an ATen op")
    if is_quant_primitive(node):
        return Declined(
            f"`{node.name}` is a quantization op ({node.target}); the Q/DQ chain stays as it came"
        )
    if allocates_memory(node):
        return Declined(f"`{node.name}` ({node.target}) allocates uninitialized memory")
    if is_impure(node) or is_mutating(node) or is_nondeterministic(node):
        return Declined(f"`{node.name}` ({node.target}) is impure, mutating or random")
    return None


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
        verdict = _op_verdict(node)
        if verdict is not None:
            return verdict
        nodes.add(node)
        for producer in node.all_input_nodes:
            if producer not in seen:
                seen.add(producer)
                stack.append(producer)
    if not custom_meta_agrees(sorted(sources, key=lambda s: s.name)):
        names = ", ".join(sorted(s.name for s in sources))
        return Declined(f"sources {names} disagree on their `custom` meta (external-file tags)")
    return Closure(seed, frozenset(nodes), frozenset(sources))


def _is_tensor_value(node: torch.fx.Node) -> bool:
    """A tensor, or a multi-output op's tensors (stored per output, never dropped to a scalar)."""
    value = node.meta.get("val")
    values = value if isinstance(value, (list, tuple)) else [value]
    return bool(values) and all(isinstance(v, torch.Tensor) for v in values)


def _value_bytes(node: torch.fx.Node) -> int | None:
    value = node.meta.get("val")
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
    kept = {n for n in nodes if not _is_tensor_value(n) and _read_outside(n, nodes)}
    stack = list(kept)
    while stack:
        for producer in stack.pop().all_input_nodes:
            if producer in nodes and not _is_tensor_value(producer) and producer not in kept:
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
    constant_bytes = sum(
        _value_bytes(node) or 0 for node in program.graph.nodes if is_static_state(program, node)
    )
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
    known = constant_sources(program, fold_buffers=True)[0] if closures else {}
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


# ---------------------------------------------------------------- rewrite


def _carry_marks(source: ExportedProgram, target: ExportedProgram) -> None:
    """Copy placeholder marks a retrace drops, matched by FQN (the marks are per FQN)."""

    def by_fqn(program: ExportedProgram) -> dict[str, torch.fx.Node]:
        nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
        return {
            s.target: nodes[s.arg.name]
            for s in program.graph_signature.input_specs
            if s.target is not None and s.arg.name in nodes
        }

    after = by_fqn(target)
    for fqn, node in by_fqn(source).items():
        for key in _CARRIED_MARKS:
            if key in node.meta and fqn in after:
                after[fqn].meta[key] = node.meta[key]


def _record(plan: WeightFoldPlan) -> None:
    for seed, reason in plan.declined:
        record_declined(FOLD, seed.where, f"weight stays dynamic: {reason}")
    for group in plan.groups:
        for closure in group.closures:
            sources = ", ".join(sorted(s.name for s in closure.sources)) or "no placeholder"
            why = (
                f"; holds {', '.join(group.must_fold)}, which no backend or portable kernel lowers"
                if group.must_fold
                else ""
            )
            record_applied(
                FOLD,
                closure.seed.where,
                f"{len(closure.nodes)} ops over {sources} folded "
                f"(group adds {group.added_bytes} B, erases {group.erased_bytes} B{why})",
            )


def _drop_checks_on(nodes: frozenset[torch.fx.Node]) -> None:
    """Export's metadata assertions on constants and on values about to become constants
    hold by construction; left in, they keep a folded-away source alive."""
    reads = nodes | {p for n in nodes for p in n.all_input_nodes if p.op == "placeholder"}
    checks = {u for n in reads for u in n.users if is_export_check(u)}
    for check in checks:
        if all(p in reads for p in check.all_input_nodes):
            check.graph.erase_node(check)


def apply_weight_folds(program: ExportedProgram, plan: WeightFoldPlan) -> ExportedProgram:
    """Rewrite: hand exactly the planned nodes to etfold's constant_prop_pass."""
    _drop_checks_on(plan.nodes_to_fold)
    return constant_prop_pass(
        program,
        custom_skip_targets=(),  # the plan already excluded quantization ops; factories fold
        nodes_to_fold=set(plan.nodes_to_fold),
        # buffers are only in the plan once proven unwritten and read by this method alone
        fold_buffers=any(g.reads_buffers for g in plan.groups),
        register_like_source=True,
    )


def _fold_once(program: ExportedProgram, slots: dict, budget: int | None):
    """(program, growth): the same object back unless something folds."""
    plan = plan_weight_folds(program, slots, budget)
    if not plan.groups:
        _record(plan)
        return program, 0
    # an in-place KV-cache write on a buffer must come out as a buffer mutation, not be folded away
    functional = program.run_decompositions({})
    _carry_marks(program, functional)
    plan = plan_weight_folds(functional, slots, budget)
    _record(plan)
    if not plan.groups:
        return functional, 0
    return apply_weight_folds(functional, plan), plan.growth


def _constants_feed_decomposed_ops(program: ExportedProgram, table, slots: dict) -> bool:
    """A constant reaches an op whose decomposition may hold more constant-only work."""
    kinds = input_kinds(program)
    return any(
        node.op == "call_function"
        and node.target in table
        and _packet(node) not in slots
        and any(kinds.get(p.name) in _STATE_KINDS for p in node.all_input_nodes)
        for node in program.graph.nodes
    )


_PROMOTING_OPS = frozenset(
    {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.where.self}
)


def _promotions(program: ExportedProgram) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(op, constant operand) pairs where the operand is implicitly widened to the op's dtype."""
    constant = constant_only_nodes(program)
    found = []
    for node in program.graph.nodes:
        result = node.meta.get("val")
        if node.op != "call_function" or node.target not in _PROMOTING_OPS:
            continue
        if not isinstance(result, torch.Tensor) or not result.dtype.is_floating_point:
            continue
        for operand in node.all_input_nodes:
            value = operand.meta.get("val")
            if operand not in constant or not isinstance(value, torch.Tensor):
                continue
            if not value.dtype.is_floating_point or value.dtype == result.dtype:
                continue
            if torch.promote_types(value.dtype, result.dtype) != result.dtype:
                continue
            found.append((node, operand))
    return found


def promote_constant_operands(program: ExportedProgram) -> ExportedProgram:
    """Make a constant operand's implicit float promotion an explicit, foldable convert.

        add(a: f32, m: bf16 constant)  ->  add(a, to_f32(m))

    Edge lowering inserts the same convert later, where it runs on every call;
    a widening float convert is exact. The same program back when there is none,
    else a rewritten copy.
    """
    if not _promotions(program):
        return program
    program = copy_for_rewrite(program)
    for node, operand in _promotions(program):
        dtype = node.meta["val"].dtype
        with program.graph.inserting_before(node):
            widened = insert_to_copy(program.graph, operand, dtype=dtype)
        node.replace_input_with(operand, widened)
    program.graph_module.recompile()
    return program


def fold_gemm_weights(
    program: ExportedProgram, slots: dict, decomposition_table=None
) -> ExportedProgram:
    """The pre-decomposition hook body: the same object back unless something folds.

    With `decomposition_table` (what the lowering will decompose), constant-only
    work that only appears after decomposition (an attention mask turned into
    `where(mask, 0, -inf)`) is folded on the decomposed program, within what is
    left of the same growth budget.
    """
    if is_training_program(program):
        record_declined(
            FOLD, "program", "training program (backward signature): parameters stay trainable"
        )
        return program
    if not slots:
        return program
    budget = growth_budget(program)
    folded, growth = _fold_once(promote_constant_operands(program), slots, budget)
    if decomposition_table is None or not _constants_feed_decomposed_ops(
        folded, decomposition_table, slots
    ):
        return folded
    decomposed = folded.run_decompositions(decomposition_table)
    _carry_marks(folded, decomposed)
    again, _ = _fold_once(promote_constant_operands(decomposed), slots, budget - growth)
    return again if again is not decomposed else folded
