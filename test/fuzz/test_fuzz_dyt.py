# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Arm DyT folds: generated DyT-then-conv programs on the TOSA reference model.

Each case is lowered by stock ExecuTorch and by etfold and run on the real
runtime; `etfold.harness.differential` judges it (see its docstring for the
oracles). CI runs the derandomized "ci" profile; tools/fuzz.py runs the long one.
"""

from hypothesis import event, given, settings

from etfold.harness import fuzz_strategies as strategies
from etfold.harness.differential import run_case
from etfold.harness.verdicts import failure_message


@settings(settings.get_profile("ci"))
@given(case=strategies.dyt_cases())
def test_generated_dyt_conv_programs_are_never_wrong(case):
    outcome = run_case(case)
    event(outcome.verdict)
    message = failure_message(case, outcome)
    assert message is None, message
