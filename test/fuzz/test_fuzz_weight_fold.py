# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""XNNPACK weight fold: generated GEMM stacks with parametrized, shared and buffer-scaled weights.

Each case is lowered by stock ExecuTorch and by etfold and run on the real
runtime; `etfold.harness.differential` judges it (see its docstring for the
oracles). CI runs the derandomized "ci" profile; tools/fuzz.py runs the long one.
"""

import pytest
from hypothesis import event, given, settings

from etfold.harness import fuzz_strategies as strategies
from etfold.harness.differential import run_case
from etfold.harness.generated_weight_fold import GemmLayer, WeightFoldCase
from etfold.harness.verdicts import failure_message


@settings(settings.get_profile("ci"))
@given(case=strategies.weight_fold_cases())
def test_generated_weight_fold_programs_are_never_wrong(case):
    outcome = run_case(case)
    event(outcome.verdict)
    message = failure_message(case, outcome)
    assert message is None, message


def test_a_conv_transpose_weight_also_read_by_other_ops_stays_right_where_stock_is_wrong():
    """Stock serializes the shared conv-transpose weight in the GEMM layout and lets the
    other readers of the parameter see that layout. etfold keeps those readers out of the
    delegate (recorded), so it has more delegates; against a wrong program that is no
    fault of etfold's."""
    from etfold.harness.generated_weight_fold import GemmLayer, WeightFoldCase

    case = WeightFoldCase(
        seed=45075,
        dims=2,
        in_channels=6,
        size=(3, 2),
        batch=1,
        layers=(
            GemmLayer("conv_transpose", 5, kernel=3, bias=False, activation="tanh"),
            GemmLayer("linear", 2, bias=False, weight="user_sum"),
        ),
        share="derived",
        buffer="none",
        second_method=True,
        dtype="float32",
    )
    outcome = run_case(case)
    assert outcome.verdict == "stock_wrong", outcome.detail
    assert outcome.etfold_error <= outcome.tolerance < outcome.baseline_error
    assert any("constant_layout:declined:p_layers_0_weight" in d for d in outcome.decisions)
    assert failure_message(case, outcome) is None


TIED_CONV1D_CASES = {
    # a plain weight: stock's Conv1dUnsqueezePass unsqueezes it for the first conv1d and
    # then fails on the second
    "plain_conv1d": dict(
        seed=2507,
        in_channels=4,
        size=(4,),
        batch=2,
        layers=(GemmLayer("conv", 5, kernel=2, stride=2, activation="relu"),),
        second_method=True,
    ),
    # a parametrized weight: stock leaves it dynamic; folded, it is one constant two
    # conv_transpose1d read
    "parametrized_conv_transpose1d": dict(
        seed=3660,
        in_channels=1,
        size=(5,),
        batch=1,
        layers=(
            GemmLayer("conv_transpose", 4, kernel=4, dilation=2, weight="user_elementwise"),
            GemmLayer("linear", 4, bias=False, weight="user_matmul"),
        ),
        buffer="written_in_forward",
    ),
}


@pytest.mark.parametrize("name", TIED_CONV1D_CASES)
def test_a_conv1d_weight_two_conv1ds_read_serves_one_of_them_in_the_delegate(name):
    """XNNPACK unsqueezes a conv1d weight in place for the first conv1d reading it; the
    second stays out of that delegate (recorded) instead of failing the lowering."""
    case = WeightFoldCase(dims=1, share="tied", dtype="float32", **TIED_CONV1D_CASES[name])
    outcome = run_case(case)
    assert outcome.verdict == "ok", outcome.detail
    assert outcome.etfold_error <= 1e-4
    kept_out = [d for d in outcome.journal if d.fold == "xnnpack.constant_layout"]
    assert any("unsqueezed to 2-D for" in d.detail for d in kept_out), outcome.decisions


def test_a_buffer_updated_by_two_methods_is_judged_on_the_state_both_share():
    """forward and a second method both update one buffer; the oracle runs each call on
    the state the previous call left, whichever method made it, as eager does."""
    from etfold.harness.generated_weight_fold import GemmLayer, WeightFoldCase

    case = WeightFoldCase(
        seed=3820,
        dims=1,
        in_channels=3,
        size=(6,),
        batch=1,
        layers=(GemmLayer("linear", 3, weight="user_elementwise"),),
        share="none",
        buffer="written_in_forward",
        second_method=True,
        dtype="float32",
    )
    outcome = run_case(case)
    assert outcome.verdict == "ok", outcome.detail
    assert outcome.etfold_error <= 1e-5 and outcome.baseline_error <= 1e-5


def test_a_method_returning_the_buffer_it_updates_lowers_where_stock_fails():
    """`update` returns a clone of the buffer it writes; stock XNNPACK drops the clone
    inside the delegate, returns one value twice and fails to lower. etfold keeps that
    clone outside (recorded) and the rollout over forward/update calls matches eager."""
    case = WeightFoldCase(
        seed=536,
        dims=1,
        in_channels=3,
        size=(6,),
        batch=2,
        layers=(GemmLayer("conv", 4, kernel=3, weight="weight_norm", activation="relu"),),
        share="none",
        buffer="written_by_other_method",
        dtype="float32",
    )
    outcome = run_case(case)
    assert outcome.verdict == "ok", outcome.detail
    assert outcome.baseline_error is None and outcome.etfold_error <= 1e-5
    kept_out = [d for d in outcome.journal if d.fold == "xnnpack.repeated_output"]
    assert kept_out and not kept_out[0].applied
