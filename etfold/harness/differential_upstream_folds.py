# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Upstream's folds around etfold's (batch norm, activation, scale fusions with shared
constants and intermediates read twice), stock vs etfold on the case's backend.

XNNPACK and TOSA FP are judged against eager (`differential_xnnpack`,
`differential_arm`). TOSA INT is judged against stock's lowering of the same model
with nothing shared (`untied`): a shared layer quantizes as its own copy would,
so that lowering is the oracle, and stock's lowering of the shared model is judged
against it too, for the catalogue.

Every fold these pipelines run is etfold's to guard, so etfold's program being as
wrong as stock's is a wrong program here (not `upstream_wrong`), and stock failing
where etfold is right is recorded: `stock_wrong`, or `crash_stock` with stock's error.
"""

from __future__ import annotations

import contextlib
import copy

from etfold.decisions import collect_decisions
from etfold.harness.attempts import attempt, attempt_eager, first_line
from etfold.harness.differential_arm import _lower_arm, differential_arm
from etfold.harness.differential_xnnpack import differential_xnnpack
from etfold.harness.generated_upstream_folds import (
    UpstreamFoldsCase,
    build_upstream_folds,
    dtype_of,
    shares_state,
    untied,
)
from etfold.harness.int_judge import judge_int
from etfold.harness.mutation_check import changes, snapshot
from etfold.harness.verdicts import Outcome, decision_text, with_verdict


def run_upstream_folds_case(case: UpstreamFoldsCase) -> Outcome:
    from etfold.harness.tosa_runner import FP

    built = build_upstream_folds(case)
    if case.backend.startswith("xnnpack"):
        outcome = differential_xnnpack(built, family=case.family, dtype=dtype_of(case))
    elif case.backend == "tosa_fp":
        outcome = differential_arm(built, family=case.family, profile=FP)
    else:
        outcome = _differential_tosa_int(built, case.family)
    return _ours_to_guard(outcome, case)


def _ours_to_guard(outcome: Outcome, case: UpstreamFoldsCase) -> Outcome:
    """etfold as wrong as stock is wrong; stock alone crashing is recorded as such, and
    stock alone wrong names the case's hazards, for KNOWN_UPSTREAM to match."""
    if outcome.verdict == "upstream_wrong":
        return with_verdict(outcome, "wrong", f"as wrong as stock: {outcome.detail}")
    if outcome.verdict == "ok" and outcome.baseline_failure is not None:
        return with_verdict(outcome, "crash_stock", outcome.baseline_failure)
    if outcome.verdict == "stock_wrong":
        return with_verdict(outcome, "stock_wrong", f"{hazards(case)}: {outcome.detail}")
    return outcome


def hazards(case: UpstreamFoldsCase) -> str:
    """What a stock wrong program is wrong on, as KNOWN_UPSTREAM's patterns read it:
    `stock wrong: <layer> + <chain>, share=<share>, reader=<extra_reader>, <backend>`."""
    chain = " + ".join(case.chain) or "nothing"
    return (
        f"stock wrong: {case.layer} + {chain}, share={case.share},"
        f" reader={case.extra_reader}, {case.backend}"
    )


def _differential_tosa_int(built, family: str) -> Outcome:
    """etfold and stock each against stock's lowering of the untied model."""
    from etfold.backends.arm import arm_folds_registered
    from etfold.harness.tosa_runner import INT

    module_before = snapshot(built.module)
    expected = attempt_eager(built)
    stock_context = contextlib.nullcontext

    def lower(module, context):
        return attempt(lambda: _lower_arm(built, INT, module, context, None, None, expected))

    stock = lower(copy.deepcopy(built.module), stock_context)
    shared = shares_state(built.module)
    reference = lower(untied(built.module), stock_context) if shared else stock
    with collect_decisions() as journal:
        ours = lower(built.module, arm_folds_registered)
    outcome = Outcome(family, "ok", decisions=[decision_text(d) for d in journal])
    outcome.journal, outcome.lowered, outcome.quantized = (
        list(journal),
        ours.program,
        ours.quantized,
    )
    mutated = changes(module_before, built.module)
    if mutated:
        return with_verdict(outcome, "mutation", f"etfold changed {mutated[:5]}")
    if ours.error is not None:
        outcome.etfold_failure = first_line(ours.error)
        if stock.error is not None:
            return with_verdict(outcome, "crash_both", first_line(stock.error))
        return with_verdict(outcome, "crash_etfold", first_line(ours.error))
    if expected is None:
        return with_verdict(outcome, "crash_both", "the model fails in eager")
    if reference.error is not None:  # nothing untied to compare with: stock is the oracle
        reference = stock
    if reference.error is not None:
        outcome.baseline_failure = first_line(stock.error)
        return outcome
    judged = judge_int(outcome, ours, reference, expected)
    if judged.verdict != "ok":
        return judged
    if stock.error is not None:
        return with_verdict(outcome, "crash_stock", first_line(stock.error))
    stock_judged = judge_int(Outcome(family, "ok"), stock, reference, expected)
    if stock_judged.verdict == "wrong":
        return with_verdict(outcome, "stock_wrong", f"stock: {stock_judged.detail}")
    return outcome
