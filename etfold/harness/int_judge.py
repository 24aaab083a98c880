# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The TOSA INT oracle: each output over the whole rollout, in LSB of that output,
against the baseline lowering and fp32 eager; and, for the integer DyT folds,
code for code against the unfolded lowering of the same quantized program.
"""

from __future__ import annotations

import copy

import torch

from etfold.harness.attempts import Attempt, attempt_eager, error_or_inf, output_scale
from etfold.harness.generated_cases import Built
from etfold.harness.verdicts import FP_TOSA_TOLERANCE, Outcome, with_verdict
from etfold.harness.xnnpack_runner import max_abs_error

# INT: within one LSB of the baseline everywhere is right (the oracle the folds promise).
# Farther apart, bounds in output LSB on how much worse than the baseline etfold may be
# against eager: an annotation-time fold changes which values are observed and rounded,
# so after a nonlinearity single elements can land a few grid steps apart either way; a
# wrong fold (wrong axis, missing bias, stale state) moves whole channels, which the mean shows.
INT_MAX_EXCESS = 3.0  # never more than this, anywhere


INT_LSB = 1.0  # beyond one LSB somewhere, the mean must not be worse ...


INT_MEAN_EXCESS = 0.1  # ... by more than this


INT_SAME_STEP = 1.0 + 1e-3  # one LSB apart, up to fp32 noise in dequantizing


def _int_excess(mine: torch.Tensor, base: torch.Tensor, ref: torch.Tensor, lsb: float):
    """(max, mean) error of `mine` minus that of `base`, against `ref`, in LSB."""
    from etfold.harness.xnnpack_runner import elementwise_error

    _check_same_layout(mine, ref)
    _check_same_layout(base, ref)
    if not ref.numel():
        return 0.0, 0.0
    mine_error, base_error = elementwise_error(mine, ref), elementwise_error(base, ref)
    max_excess = (float(mine_error.max()) - float(base_error.max())) / lsb
    mean_excess = (float(mine_error.mean()) - float(base_error.mean())) / lsb
    return max_excess, mean_excess


def _within_one_step(mine: torch.Tensor, base: torch.Tensor, lsb: float) -> bool:
    """Every element at most one LSB from the baseline's (NaN anywhere is not)."""
    if not base.numel():
        return True
    return bool(((mine - base).abs() <= INT_SAME_STEP * lsb).all())


def _check_same_layout(actual: torch.Tensor, expected: torch.Tensor) -> None:
    max_abs_error([actual], [expected])  # raises on a count, shape or dtype mismatch


def judge_int(outcome: Outcome, ours: Attempt, baseline: Attempt, expected) -> Outcome:
    """Each output over the whole rollout, in LSB of that output: within one LSB of the
    baseline's everywhere, or else, against eager, etfold's max error at most
    INT_MAX_EXCESS above the baseline's and, where it is more than INT_LSB above, its
    mean error at most INT_MEAN_EXCESS above. Then delegates.

    A rollout is judged whole: where an output's own rounding noise is many LSB (a
    fine grid after a coarse input), which step shows the noise's peak is luck, while
    drift from a wrong fold raises the peak and the mean over the steps."""
    for step, (mine, base, ref) in enumerate(
        zip(ours.outputs, baseline.outputs, expected, strict=True)
    ):
        if len(mine) != len(ref) or len(base) != len(ref):
            return with_verdict(
                outcome, "wrong", f"step {step}: {len(mine)} outputs, eager {len(ref)}"
            )
        for index, (m, b, e) in enumerate(zip(mine, base, ref, strict=True)):
            try:
                _check_same_layout(m, e)
                _check_same_layout(b, e)
            except AssertionError as mismatch:
                return with_verdict(outcome, "wrong", f"step {step} output {index}: {mismatch}")
    outcome.etfold_error = error_or_inf(ours.outputs, expected)
    outcome.baseline_error = error_or_inf(baseline.outputs, expected)
    for index in range(len(expected[0]) if expected else 0):
        m, b, e = (
            _over_the_rollout(run, index) for run in (ours.outputs, baseline.outputs, expected)
        )
        lsbs = [s for s in (ours.lsb[index], baseline.lsb[index]) if s is not None]
        lsb = max(lsbs) if lsbs else FP_TOSA_TOLERANCE * output_scale([[e]])
        if _within_one_step(m, b, lsb):
            continue
        max_excess, mean_excess = _int_excess(m, b, e, lsb)
        too_far = max_excess > INT_MAX_EXCESS
        if too_far or (max_excess > INT_LSB and mean_excess > INT_MEAN_EXCESS):
            return with_verdict(
                outcome,
                "wrong",
                f"output {index} over {len(expected)} step(s): {max_excess:.2f} LSB worse than"
                f" the baseline at most, {mean_excess:.3f} LSB on average (lsb {lsb:.3g})",
            )
    if ours.delegates > baseline.delegates:
        return with_verdict(outcome, "more_delegates", f"{ours.delegates} > {baseline.delegates}")
    return outcome


def _over_the_rollout(run: list[list[torch.Tensor]], index: int) -> torch.Tensor:
    """Output `index` of every step, flattened into one tensor."""
    return torch.cat([step[index].reshape(-1) for step in run])


def codes_match_unfolded(built: Built, outcome: Outcome) -> str | None:
    """etfold's integer lowering vs the unfolded lowering of the very same quantized program:
    every delegate code equal (the integer DyT folds claim exactness).

    Returns None when they match, else a description.
    """
    from etfold.backends.arm.registration import upstream_folds_retired
    from etfold.harness.tosa_runner import INT, lower_tosa, max_code_difference

    try:
        with upstream_folds_retired():
            unfolded = lower_tosa(copy.deepcopy(outcome.quantized), INT)
    except Exception:
        return None  # nothing to compare with: not etfold's failure
    eager = attempt_eager(built)
    for step, call in enumerate(built.calls):
        try:
            expected = unfolded.run(*call.inputs)
        except RuntimeError:
            return None  # the unfolded lowering does not run (an upstream bug, KNOWN_UPSTREAM)
        ours = outcome.lowered.run(*call.inputs)
        if eager is not None and _farther_from_eager(expected, ours, eager[step], unfolded):
            return None  # the unfolded lowering is the wrong one (an upstream bug)
        difference = max_code_difference(ours, expected)
        if difference:
            return f"integer folds differ from the unfolded lowering by {difference} LSB"
    return None


def _farther_from_eager(unfolded, ours, eager: list[torch.Tensor], program) -> bool:
    """The unfolded lowering misses eager by more than INT_MAX_EXCESS LSB beyond etfold's miss."""
    from etfold.harness.tosa_runner import output_scales
    from etfold.harness.xnnpack_runner import max_abs_error

    lsbs = [s for s in output_scales(program)[-len(eager) :] if s is not None]
    if not lsbs:
        return False
    excess = max_abs_error(unfolded.outputs, eager) - max_abs_error(ours.outputs, eager)
    return excess > INT_MAX_EXCESS * max(lsbs)
