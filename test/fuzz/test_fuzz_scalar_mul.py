# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Arm scalar-mul fold: generated conv * scale programs on the TOSA reference model.

Each case is lowered by stock ExecuTorch and by etfold and run on the real
runtime; `etfold.harness.differential` judges it (see its docstring for the
oracles). CI runs the derandomized "ci" profile; tools/fuzz.py runs the long one.
"""

from hypothesis import event, example, given, settings

from etfold.harness import fuzz_strategies as strategies
from etfold.harness.differential import run_case
from etfold.harness.generated_scalar_mul import ScalarMulCase
from etfold.harness.verdicts import failure_message

# Beside the generated cases, two that every run checks: a per-channel scale over
# a wide range (the fold must apply, on the right axis) and a NaN scale (it must not).
PER_CHANNEL_WIDE = ScalarMulCase(0, "conv2d", 3, 4, 5, True, "per_channel", "wide", profile="FP")
NAN_PER_CHANNEL = ScalarMulCase(0, "conv1d", 2, 3, 4, True, "per_channel", "nan", profile="FP")


@settings(settings.get_profile("ci"))
@example(case=PER_CHANNEL_WIDE)
@example(case=NAN_PER_CHANNEL)
@given(case=strategies.scalar_mul_cases())
def test_generated_conv_scale_programs_are_never_wrong(case):
    outcome = run_case(case)
    event(outcome.verdict)
    message = failure_message(case, outcome)
    assert message is None, message
