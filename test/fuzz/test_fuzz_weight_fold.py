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

import fuzz_strategies as strategies
from hypothesis import event, given, settings

from etfold.harness.differential import failure_message, run_case


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
    from etfold.harness.generated import GemmLayer, WeightFoldCase

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


def test_a_strided_conv1d_tied_to_itself_fails_in_stock_xnnpack_and_is_a_known_upstream_crash():
    """Upstream's Conv1dUnsqueezePass raises when a second conv1d reads the same weight;
    etfold fails the same way and the harness lists it as upstream's."""
    from etfold.harness.differential import known_upstream
    from etfold.harness.generated import GemmLayer, WeightFoldCase

    case = WeightFoldCase(
        seed=2507,
        dims=1,
        in_channels=4,
        size=(4,),
        batch=2,
        layers=(GemmLayer("conv", 5, kernel=2, stride=2, activation="relu"),),
        share="tied",
        buffer="none",
        second_method=True,
        dtype="float32",
    )
    outcome = run_case(case)
    assert outcome.verdict == "crash_both", outcome.detail
    assert known_upstream(outcome.detail)
    assert failure_message(case, outcome) is None


def test_a_buffer_updated_by_two_methods_is_judged_on_the_state_both_share():
    """forward and a second method both update one buffer; the oracle runs each call on
    the state the previous call left, whichever method made it, as eager does."""
    from etfold.harness.generated import GemmLayer, WeightFoldCase

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
