# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""XNNPACK dtype converts: generated chains of fp32/bf16/fp16 regions joined by casts.

Each case is lowered by stock ExecuTorch and by etfold and run on the real
runtime; `etfold.harness.differential` judges it (see its docstring for the
oracles). CI runs the derandomized "ci" profile; tools/fuzz.py runs the long one.
"""

import pytest
from hypothesis import event, given, settings

from etfold.harness import fuzz_strategies as strategies
from etfold.harness.differential import run_case
from etfold.harness.generated_converts import ConvertRegion, ConvertsCase
from etfold.harness.verdicts import failure_message, known_upstream


@settings(settings.get_profile("ci"))
@given(case=strategies.converts_cases())
def test_generated_mixed_precision_programs_are_never_wrong(case):
    outcome = run_case(case)
    event(outcome.verdict)
    message = failure_message(case, outcome)
    assert message is None, message


# Stock ExecuTorch fails on these, and etfold fails the same way (it does not hide the
# upstream error); the harness lists each as upstream's: (the case, what the error names).
KNOWN_UPSTREAM_CASES = {
    # size-1 channel and width dims: several dim orders share one set of strides, and
    # stock's lowering derives [0, 2, 1, 3], which names no memory format
    "dim_order_naming_no_memory_format": (
        ConvertsCase(
            seed=44125,
            channels=1,
            size=(3, 1),
            model_dtype="float16",
            regions=(
                ConvertRegion("float32", "conv", channels_last=True),
                ConvertRegion("float32", "conv", channels_last=True),
                ConvertRegion("float32", "add_residual"),
                ConvertRegion("float32", "add_residual", channels_last=True),
            ),
        ),
        "dim_order",
    ),
    # the portable dim-order copy checks the output's dim order against the one its
    # strides imply; over a size-1 channel dim they disagree
    "channels_last_copy_over_one_channel": (
        ConvertsCase(
            seed=436,
            channels=1,
            size=(4, 5),
            model_dtype="float32",
            regions=(
                ConvertRegion("float16", "norm_in_fp32", channels_last=True),
                ConvertRegion("float32", "norm_in_fp32", channels_last=True),
                ConvertRegion("float16", "const_cast", channels_last=True),
                ConvertRegion("float32", "linear"),
            ),
        ),
        "0x12",
    ),
    # XNNPACK cannot resize the static output of a delegate whose single-channel result
    # it computes in another dim order ('Failed to resize output tensor')
    "delegate_output_resize_over_one_channel": (
        ConvertsCase(
            seed=252,
            channels=1,
            size=(2, 5),
            model_dtype="float16",
            regions=(
                ConvertRegion("float32", "linear"),
                ConvertRegion("float32", "norm_in_fp32", channels_last=True),
                ConvertRegion("float16", "add_residual"),
                ConvertRegion("float16", "gelu"),
            ),
        ),
        "0x10",
    ),
}


@pytest.mark.parametrize("name", KNOWN_UPSTREAM_CASES)
def test_a_stock_failure_over_one_channel_is_shared_and_listed_as_upstream(name):
    case, named = KNOWN_UPSTREAM_CASES[name]
    outcome = run_case(case)
    assert outcome.verdict == "crash_both", outcome.detail
    assert named in outcome.detail and known_upstream(outcome.detail)
    assert failure_message(case, outcome) is None
