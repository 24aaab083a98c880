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

Each round plans on the program (`weight_fold_plan`) and, when something folds,
plans again on its functionalized form and hands exactly the planned nodes to
`constant_prop_pass`. With the lowering's decomposition table, a second round
folds the constant-only work that only appears after decomposition, within what
is left of the same growth budget.

The modules: `weight_fold_seeds` (what is worth folding, and the verdicts it
asks), `weight_fold_plan` (closures, groups, the growth budget),
`weight_fold_promotion` (implicit float promotions made explicit); this one runs
the rounds (before and after decomposition) and hands the plan to
`constant_prop_pass`.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram

from etfold.backends.xnnpack.partition.weight_fold_plan import (
    WeightFoldPlan,
    growth_budget,
    plan_weight_folds,
)
from etfold.backends.xnnpack.partition.weight_fold_promotion import promote_constant_operands
from etfold.backends.xnnpack.partition.weight_fold_seeds import (
    WEIGHT_FOLD_OPS,
    is_export_check,
    op_packet,
)
from etfold.decisions import record_applied, record_declined
from etfold.exir.passes.constant_prop_pass import constant_prop_pass
from etfold.exir.passes.graph_walk import state_placeholders
from etfold.exir.passes.inline_autocast_regions_pass import is_training_program
from etfold.exir.program.buffer_marks import BUFFER_FOLD_BLOCKERS
from etfold.exir.program.method_marks import SHARED_ACROSS_METHODS

FOLD = "xnnpack.fold_gemm_weight"
# placeholder meta the fold reads; a retrace may drop it ("custom" holds external-file tags)
_CARRIED_MARKS = (SHARED_ACROSS_METHODS, BUFFER_FOLD_BLOCKERS, "custom")


def carry_placeholder_marks(source: ExportedProgram, target: ExportedProgram) -> None:
    """Copy placeholder marks a retrace drops, matched by FQN (the marks are per FQN)."""
    after = state_placeholders(target)
    for fqn, node in state_placeholders(source).items():
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
        custom_skip_targets=WEIGHT_FOLD_OPS,  # the plan's own op policy
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
    carry_placeholder_marks(program, functional)
    plan = plan_weight_folds(functional, slots, budget)
    _record(plan)
    if not plan.groups:
        return functional, 0
    return apply_weight_folds(functional, plan), plan.growth


def _constants_feed_decomposed_ops(program: ExportedProgram, table, slots: dict) -> bool:
    """A constant reaches an op whose decomposition may hold more constant-only work."""
    state = set(state_placeholders(program).values())
    return any(
        node.op == "call_function"
        and node.target in table
        and op_packet(node) not in slots
        and any(p in state for p in node.all_input_nodes)
        for node in program.graph.nodes
    )


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
    carry_placeholder_marks(folded, decomposed)
    again, _ = _fold_once(promote_constant_operands(decomposed), slots, budget - growth)
    return again if again is not decomposed else folded
