# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Upstream's folds around etfold's: generated conv/linear + batch norm / activation /
scale chains with shared and equal constants, on XNNPACK, TOSA FP and TOSA INT.

Each case is lowered by stock ExecuTorch and by etfold and run on the real
runtime; `etfold.harness.differential_upstream_folds` judges it. CI runs the
derandomized "ci" profile and the hand-picked cases below; the `long` marker
runs more draws; tools/fuzz.py --families upstream_folds runs the long profile.
"""

import pytest
from hypothesis import event, example, given, settings

from etfold.harness import fuzz_strategies as strategies
from etfold.harness.differential import run_case
from etfold.harness.generated_upstream_folds import UpstreamFoldsCase
from etfold.harness.verdicts import failure_message, known_upstream


def _case(**fields) -> UpstreamFoldsCase:
    defaults = dict(seed=0, in_channels=4, out_channels=6, size=5, batch=1, bias=True)
    return UpstreamFoldsCase(**{**defaults, **fields})


# The model: two convs, one weight, a batch norm each; stock fuses both into
# the first conv's fused weight.
SHARED_WEIGHT_XNNPACK = _case(layer="conv2d", chain=("bn",), share="weight")
SHARED_BIAS_TOSA_FP = _case(layer="conv1d", chain=("bn", "relu"), share="bias", backend="tosa_fp")


def _judged(case: UpstreamFoldsCase):
    outcome = run_case(case)
    message = failure_message(case, outcome)
    assert message is None, message
    if outcome.verdict == "stock_wrong":  # every stock wrong program is catalogued
        assert known_upstream(outcome.detail), f"stock wrong, not in KNOWN_UPSTREAM: {case!r}"
    return outcome


@pytest.mark.parametrize(
    "case", [SHARED_WEIGHT_XNNPACK, SHARED_BIAS_TOSA_FP], ids=["xnnpack", "tosa_fp"]
)
def test_stock_is_wrong_on_a_shared_constant_and_etfold_is_not(case):
    outcome = _judged(case)
    assert outcome.verdict == "stock_wrong", outcome
    assert any("own_constants_before_batch_norm_fusion:applied" in d for d in outcome.decisions)


@settings(settings.get_profile("ci"))
@given(case=strategies.upstream_folds_cases())
def test_generated_upstream_fold_programs_are_never_wrong(case):
    event(_judged(case).verdict)


@pytest.mark.long
@settings(settings.get_profile("ci"), max_examples=40)
@example(case=_case(layer="depthwise", chain=("bn",), share="three", backend="xnnpack_fp16"))
@example(case=_case(layer="transposed2d", chain=("bn",), share="weight", backend="tosa_int"))
@given(case=strategies.upstream_folds_cases())
def test_generated_upstream_fold_programs_are_never_wrong_long(case):
    event(_judged(case).verdict)
