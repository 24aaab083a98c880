# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The Arm baseline lowering vs etfold's on the TOSA reference model for one case:
INT judged by `int_judge`, FP against eager; scalar-mul guards checked against
the case's scale.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch
from torch.export import ExportedProgram

from etfold.decisions import collect_decisions
from etfold.harness import generated
from etfold.harness.attempts import (
    Attempt,
    Prepare,
    attempt,
    attempt_eager,
    calibrated_on_the_rollout,
    output_scale,
    rollout,
)
from etfold.harness.generated_cases import Built
from etfold.harness.generated_dyt import DyTCase
from etfold.harness.generated_scalar_mul import NON_FINITE_SCALES, ScalarMulCase
from etfold.harness.int_judge import codes_match_unfolded, judge_int
from etfold.harness.mutation_check import changes, snapshot
from etfold.harness.verdicts import (
    FP_TOSA_TOLERANCE,
    Outcome,
    decision_text,
    judge_floats,
    with_verdict,
)


def _arm_baseline(case) -> Callable:
    """Scalar-mul: stock with its own (unguarded) fold retired; otherwise stock as shipped."""
    from etfold.backends.arm.registration import upstream_folds_retired

    return upstream_folds_retired if isinstance(case, ScalarMulCase) else contextlib.nullcontext


def _profile(case) -> str:
    from etfold.harness.tosa_runner import FP, INT

    return FP if getattr(case, "profile", "INT") == "FP" else INT


def _quantized_or_exported(
    module, built: Built, profile: str, prepare: Prepare | None = None, dynamic_shapes=None
) -> ExportedProgram:
    from etfold.backends.arm import mark_carried_state_outputs
    from etfold.harness.tosa_runner import INT, quantize_exported_for_tosa

    inputs = built.calls[0].inputs
    exported = torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes)
    if built.feedback is not None:
        mark_carried_state_outputs(exported, [built.feedback[0]])
    if prepare is not None:
        prepare(exported)
    if profile != INT:
        return exported
    return quantize_exported_for_tosa(exported, inputs, calibration=built.calibration)


def _run_tosa(built: Built, program, forced=None) -> list[list[torch.Tensor]]:
    from etfold.harness.tosa_runner import run_carried

    if built.feedback is None:  # one program instance: buffer writes carry to the next call
        return [list(r.outputs) for r in run_carried(program, [c.inputs for c in built.calls])]
    return rollout(built, lambda _method, inputs: program.run(*inputs).outputs, forced)


def _lower_arm(
    built: Built,
    profile: str,
    module,
    context,
    prepare: Prepare | None,
    dynamic_shapes=None,
    forced=None,
) -> Attempt:
    from etfold.harness.tosa_runner import INT, lower_tosa, output_scales

    with context():
        quantized = _quantized_or_exported(module, built, profile, prepare, dynamic_shapes)
        kept = copy.deepcopy(quantized)
        program = lower_tosa(quantized, profile)
    outputs = _run_tosa(built, program, forced)
    users = len(outputs[0])
    lsb = output_scales(program)[-users:] if profile == INT else [None] * users
    return Attempt(outputs, delegates=program.delegates(), lsb=lsb, program=program, quantized=kept)


def differential_arm(
    built: Built,
    *,
    family: str = "arm",
    profile: str = "TOSA-1.0+INT",
    baseline_context: Callable = contextlib.nullcontext,
    prepare: Prepare | None = None,
    dynamic_shapes=None,
) -> Outcome:
    """The baseline lowering vs etfold's (`arm_folds_registered`) on the TOSA reference model.

    The baseline lowers a deep copy; etfold lowers the user's module itself, which
    must come back unchanged. `prepare` edits each export before quantization.
    """
    from etfold.backends.arm import arm_folds_registered

    module_before = snapshot(built.module)
    expected = attempt_eager(built)
    built = calibrated_on_the_rollout(built, expected)
    copied = copy.deepcopy(built.module)
    baseline = attempt(
        lambda: _lower_arm(
            built, profile, copied, baseline_context, prepare, dynamic_shapes, expected
        )
    )
    with collect_decisions() as journal:
        ours = attempt(
            lambda: _lower_arm(
                built,
                profile,
                built.module,
                arm_folds_registered,
                prepare,
                dynamic_shapes,
                expected,
            )
        )
    outcome = Outcome(family, "ok", decisions=[decision_text(d) for d in journal])
    outcome.journal, outcome.lowered, outcome.quantized = (
        list(journal),
        ours.program,
        ours.quantized,
    )
    mutated = changes(module_before, built.module)
    if mutated:
        return with_verdict(outcome, "mutation", f"etfold changed {mutated[:5]}")
    int_profile = profile.endswith("INT")
    if ours.error is None and baseline.error is None and int_profile and expected is not None:
        return judge_int(outcome, ours, baseline, expected)
    tolerance = FP_TOSA_TOLERANCE * output_scale(expected or baseline.outputs or [])
    return judge_floats(outcome, ours, baseline, expected, tolerance)


def run_arm_case(case: ScalarMulCase | DyTCase) -> Outcome:
    built = generated.build(case)
    outcome = differential_arm(
        built, family=case.family, profile=_profile(case), baseline_context=_arm_baseline(case)
    )
    guard = _guard_violation(case, outcome.journal)
    if guard:
        return with_verdict(outcome, "wrong", guard)
    if isinstance(case, DyTCase) and outcome.verdict == "ok":
        mismatch = codes_match_unfolded(built, outcome)
        if mismatch:
            return with_verdict(outcome, "wrong", mismatch)
    return outcome


def _guard_violation(case, journal) -> str | None:
    """A scalar-mul fold of a scale that is not a finite constant along channels."""
    if not isinstance(case, ScalarMulCase):
        return None
    must_decline = case.scale_values in NON_FINITE_SCALES or case.scale_kind in (
        "activation",
        "spatial",
    )
    applied = [d for d in journal if d.fold == "arm.scalar_mul_into_conv" and d.applied]
    foldable = 1 if case.share else 0  # the shared-weight branch has a finite per-channel scale
    if must_decline and len(applied) > foldable:
        where = ", ".join(d.where for d in applied)
        return f"folded a {case.scale_kind} {case.scale_values} scale: {where}"
    return None
