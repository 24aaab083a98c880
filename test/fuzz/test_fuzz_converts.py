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

import fuzz_strategies as strategies
from hypothesis import event, given, settings

from etfold.harness.differential import failure_message, run_case


@settings(settings.get_profile("ci"))
@given(case=strategies.converts_cases())
def test_generated_mixed_precision_programs_are_never_wrong(case):
    outcome = run_case(case)
    event(outcome.verdict)
    message = failure_message(case, outcome)
    assert message is None, message


def test_channels_last_convs_over_one_channel_fail_in_stock_to_edge_and_are_a_known_upstream_crash():
    """With size-1 channel and width dims several dim orders share one set of strides;
    stock's lowering derives [0, 2, 1, 3], which names no memory format, and raises.
    etfold fails the same way (it does not hide the upstream error), and the harness
    lists it as upstream's."""
    from etfold.harness.differential import known_upstream
    from etfold.harness.generated import ConvertRegion, ConvertsCase

    case = ConvertsCase(
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
    )
    outcome = run_case(case)
    assert outcome.verdict == "crash_both", outcome.detail
    assert known_upstream(outcome.detail)
    assert failure_message(case, outcome) is None


def test_a_channels_last_cast_over_one_channel_fails_in_stock_runtime_and_is_a_known_upstream_crash():
    """The portable dim-order copy checks the output's dim order against the one its
    strides imply; over a size-1 channel dim they disagree and the runtime rejects the
    call, in stock and in etfold alike."""
    from etfold.harness.differential import known_upstream
    from etfold.harness.generated import ConvertRegion, ConvertsCase

    case = ConvertsCase(
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
    )
    outcome = run_case(case)
    assert outcome.verdict == "crash_both", outcome.detail
    assert "0x12" in outcome.detail and known_upstream(outcome.detail)
    assert failure_message(case, outcome) is None


def test_a_delegate_output_over_one_channel_that_fails_to_resize_is_a_known_upstream_crash():
    """XNNPACK cannot resize the static output of a delegate whose single-channel result
    it computes in another dim order ('Failed to resize output tensor'); stock and etfold
    alike."""
    from etfold.harness.differential import known_upstream
    from etfold.harness.generated import ConvertRegion, ConvertsCase

    case = ConvertsCase(
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
    )
    outcome = run_case(case)
    assert outcome.verdict == "crash_both", outcome.detail
    assert "0x10" in outcome.detail and known_upstream(outcome.detail)
    assert failure_message(case, outcome) is None
