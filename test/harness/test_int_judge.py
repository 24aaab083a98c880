# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The TOSA INT judge of the differential harness: what counts as a wrong program.

Outputs are built on an LSB grid by hand, so each verdict follows from the rule
alone: within one LSB of the baseline is right; farther apart, etfold must not be
much farther from eager than the baseline.
"""

from __future__ import annotations

import math

import torch

from etfold.harness.attempts import Attempt
from etfold.harness.int_judge import INT_MAX_EXCESS, judge_int
from etfold.harness.verdicts import Outcome

LSB = 0.01


def judge(mine: torch.Tensor, base: torch.Tensor, eager: torch.Tensor) -> Outcome:
    return judge_rollout([mine], [base], [eager])


def judge_rollout(mine: list, base: list, eager: list) -> Outcome:
    """One output per step."""
    ours = Attempt(outputs=[[m] for m in mine], lsb=[LSB])
    baseline = Attempt(outputs=[[b] for b in base], lsb=[LSB])
    return judge_int(Outcome("test", "ok"), ours, baseline, [[e] for e in eager])


def grid(codes) -> torch.Tensor:
    return torch.tensor(codes, dtype=torch.float32) * LSB


def test_one_step_from_the_baseline_everywhere_is_right_even_when_farther_from_eager():
    eager = grid([0.0] * 12)
    base = grid([0.0] * 12)
    # one LSB worse on every element, on average too, with dequantizing's fp32 noise on top
    mine = grid([1.0 + 5e-4] * 12)
    assert judge(mine, base, eager).verdict == "ok"


def test_a_whole_channel_two_steps_off_is_wrong():
    eager = grid([0.0] * 12)
    base = grid([0.0] * 12)
    mine = grid([2.0] * 6 + [0.0] * 6)
    outcome = judge(mine, base, eager)
    assert outcome.verdict == "wrong"
    assert "LSB worse than the baseline" in outcome.detail


def test_two_steps_apart_but_no_farther_from_eager_is_right():
    eager = grid([1.0] * 12)
    base = grid([0.0] * 12)  # the baseline misses eager by one step ...
    mine = grid([2.0] * 12)  # ... etfold by one step the other way
    assert judge(mine, base, eager).verdict == "ok"


def test_a_single_element_beyond_the_max_excess_is_wrong():
    eager = grid([0.0] * 12)
    base = grid([0.0] * 12)
    mine = grid([0.0] * 11 + [math.floor(INT_MAX_EXCESS) + 1.0])
    assert judge(mine, base, eager).verdict == "wrong"


def test_nan_where_the_baseline_is_finite_is_wrong():
    eager = grid([0.0] * 4)
    base = grid([0.0] * 4)
    mine = grid([0.0, 0.0, 0.0, math.nan])
    assert judge(mine, base, eager).verdict == "wrong"


def test_a_rollout_is_judged_whole_where_each_lowering_peaks_at_another_step():
    """A noisy output (errors of many LSB in both lowerings): etfold's peak falls at step
    1 and the baseline's at step 0, equally high; over the rollout neither is worse."""
    eager = [grid([0.0] * 8)] * 2
    base = [grid([9.0] + [1.0] * 7), grid([1.0] * 8)]
    mine = [grid([1.0] * 8), grid([9.0] + [1.0] * 7)]
    assert judge_rollout(mine, base, eager).verdict == "ok"


def test_drift_over_a_rollout_is_wrong():
    eager = [grid([0.0] * 8)] * 3
    base = [grid([1.0] * 8)] * 3
    mine = [grid([1.0] * 8), grid([3.0] * 8), grid([6.0] * 8)]
    outcome = judge_rollout(mine, base, eager)
    assert outcome.verdict == "wrong"
    assert "over 3 step(s)" in outcome.detail
