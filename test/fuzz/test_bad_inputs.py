# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Bad inputs at both entry points: never a wrong program, a mutation or a crash stock lacks.

Entry points: XNNPACK is `etfold.exir.to_edge_transform_and_lower` with
`etfold.backends.xnnpack.XnnpackPartitioner`; Arm is a TOSA lowering inside
`arm_folds_registered()` (what `register_arm_folds()` installs). Each bad input is
lowered by stock ExecuTorch and by etfold and judged by the differential oracle:
etfold either lowers a program as right as stock's (its fold applied, or declined
with a reason on record), or fails where stock fails too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from etfold.backends.arm._passes import fold_scalar_mul_into_conv_pass as scalar_mul
from etfold.harness.differential_arm import differential_arm
from etfold.harness.differential_xnnpack import differential_xnnpack
from etfold.harness.generated import build
from etfold.harness.generated_cases import Built, Call
from etfold.harness.generated_scalar_mul import ScalarMulCase
from etfold.harness.tosa_runner import FP, INT
from etfold.harness.verdicts import FAILURES


def _built(module: nn.Module, *inputs: torch.Tensor) -> Built:
    return Built(module.eval(), {"forward": inputs}, [Call("forward", inputs)])


def _acceptable(outcome) -> None:
    assert outcome.verdict not in FAILURES, f"{outcome.verdict}: {outcome.detail}"
    if outcome.verdict == "crash_both":  # etfold adds no failure of its own: it fails as stock does
        assert outcome.etfold_failure == outcome.detail, outcome.etfold_failure


def _declined(outcome, fold: str) -> list[str]:
    return [d.detail for d in outcome.journal if d.fold == fold and not d.applied]


class NormedConv(nn.Module):
    def __init__(self, in_channels: int = 3, dtype: torch.dtype = torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.conv = weight_norm(nn.Conv2d(in_channels, 4, 3, padding=1)).to(dtype)

    def forward(self, x):
        return self.conv(x)


# ---------------------------------------------------------------- XNNPACK entry point


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0], ids=["nan", "inf", "zero"])
def test_xnnpack_weight_norm_with_a_non_finite_or_zero_magnitude(value):
    module = NormedConv()
    with torch.no_grad():
        module.conv.parametrizations.weight.original0[1] = value
    _acceptable(differential_xnnpack(_built(module, torch.randn(1, 3, 5, 5))))


def test_xnnpack_dynamic_batch():
    batch = torch.export.Dim("batch", min=1, max=8)
    built = _built(NormedConv(), torch.randn(2, 3, 5, 5))
    _acceptable(differential_xnnpack(built, dynamic_shapes=({0: batch},)))


def test_xnnpack_program_whose_nodes_lost_their_meta_val():
    def drop_meta_val(program):
        for node in program.graph.nodes:
            if node.op == "call_function" and "convolution" not in str(node.target):
                node.meta.pop("val", None)

    built = _built(NormedConv(), torch.randn(1, 3, 5, 5))
    _acceptable(differential_xnnpack(built, prepare=drop_meta_val))


class Int8Input(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = NormedConv()

    def forward(self, x):
        return self.inner(x.float() / 16)


class ComplexWeight(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(4, 3, 3, 3, dtype=torch.complex64))

    def forward(self, x):
        return nn.functional.conv2d(x, (self.weight * self.weight).real, padding=1)


@pytest.mark.parametrize(
    ("make", "x", "dtype"),
    [
        (Int8Input, torch.randint(-100, 100, (1, 3, 5, 5), dtype=torch.int8), torch.float32),
        (ComplexWeight, torch.randn(1, 3, 5, 5), torch.float32),
        (lambda: NormedConv(dtype=torch.float64), torch.randn(1, 3, 5, 5).double(), torch.float32),
    ],
    ids=["int8_activations", "complex_weight", "float64"],
)
def test_xnnpack_unsupported_dtypes(make, x, dtype):
    _acceptable(differential_xnnpack(_built(make(), x), dtype=dtype))


def test_xnnpack_empty_input():
    _acceptable(differential_xnnpack(_built(NormedConv(), torch.randn(0, 3, 5, 5))))


class InverseMix(nn.Module):
    """w -> inv(mix) @ w: registered with mix = I, then made singular, so computing it raises."""

    def __init__(self, rows: int):
        super().__init__()
        self.register_buffer("mix", torch.eye(rows))

    def forward(self, w):
        return (torch.linalg.inv(self.mix) @ w.flatten(1)).reshape(w.shape)


def raising_parametrization(conv: nn.Module) -> nn.Module:
    parametrize.register_parametrization(conv, "weight", InverseMix(conv.out_channels))
    with torch.no_grad():
        conv.parametrizations.weight[0].mix.fill_(1.0)
    return conv


def test_xnnpack_parametrization_that_raises():
    """The weight fold declines the singular inverse (its evaluation raises), so the
    program fails at to_edge on the non-Core-ATen op exactly as stock does."""
    module = raising_parametrization(nn.Conv2d(3, 4, 3, padding=1))
    outcome = differential_xnnpack(_built(module, torch.randn(1, 3, 5, 5)))
    assert outcome.verdict == "crash_both" and "Core ATen" in outcome.etfold_failure
    assert any("evaluation raised" in d for d in outcome.decisions)
    _acceptable(outcome)


# ---------------------------------------------------------------- Arm entry point


# an infinite scale in `make test-long`: the fold declines it by the one predicate that
# declines a NaN, proven for both at graph level in make test
# (test_fold_scalar_mul_into_conv_pass::test_declines_when_scale_is_not_finite[nan, inf])
@pytest.mark.parametrize("values", ["nan", pytest.param("inf", marks=pytest.mark.long), "zeros"])
def test_arm_scale_that_is_non_finite_or_zero(values):
    case = ScalarMulCase(0, "conv2d", 3, 4, 5, True, "per_channel", values, profile="FP")
    outcome = differential_arm(build(case), profile=FP)
    _acceptable(outcome)
    if values != "zeros":
        assert scalar_mul.SCALE_NOT_FINITE in _declined(outcome, scalar_mul.FOLD)


class BiasOverflow(nn.Module):
    """Tiny weights, a large bias and a large scale: the folded int32 bias would overflow."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        with torch.no_grad():
            self.conv.weight.fill_(1e-6)
            self.conv.bias.fill_(1e4)
        self.register_buffer("scale", torch.full((1, 4, 1, 1), 100.0))

    def forward(self, x):
        return self.conv(x) * self.scale


def test_arm_int32_bias_overflow_after_folding():
    built = _built(BiasOverflow(), torch.randn(1, 3, 5, 5))
    built.calibration = [(torch.randn(1, 3, 5, 5),)]
    _acceptable(differential_arm(built, profile=INT))


class ConvTimesScale(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1).to(dtype)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 4, dtype=dtype).reshape(1, 4, 1, 1))

    def forward(self, x):
        return self.conv(x.to(self.conv.weight.dtype)) * self.scale


def test_arm_dynamic_batch():
    batch = torch.export.Dim("batch", min=1, max=8)
    built = _built(ConvTimesScale(), torch.randn(2, 3, 5, 5))
    _acceptable(differential_arm(built, profile=FP, dynamic_shapes=({0: batch},)))


def test_arm_program_whose_mul_lost_its_meta_val():
    def drop_meta_val(program):
        for node in program.graph.nodes:
            if node.op == "call_function" and "mul" in str(node.target):
                node.meta.pop("val", None)

    dropped = differential_arm(
        _built(ConvTimesScale(), torch.randn(1, 3, 5, 5)), profile=FP, prepare=drop_meta_val
    )
    _acceptable(dropped)


@pytest.mark.parametrize(
    ("module", "x"),
    [
        (ConvTimesScale(), torch.randint(-100, 100, (1, 3, 5, 5), dtype=torch.int8)),
        (ConvTimesScale(torch.float64), torch.randn(1, 3, 5, 5).double()),
    ],
    ids=["int8_activations", "float64"],
)
def test_arm_unsupported_dtypes(module, x):
    _acceptable(differential_arm(_built(module, x), profile=FP))


def test_arm_empty_input():
    _acceptable(differential_arm(_built(ConvTimesScale(), torch.randn(1, 3, 0, 5)), profile=FP))


def test_arm_parametrization_that_raises():
    module = ConvTimesScale()
    raising_parametrization(module.conv)
    _acceptable(differential_arm(_built(module, torch.randn(1, 3, 5, 5)), profile=FP))
