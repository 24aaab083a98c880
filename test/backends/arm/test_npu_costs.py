# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""NPU cost rules: a fold declines exactly where Vela would schedule it worse, per target."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.arm import arm_folds_registered
from etfold.backends.arm._passes.fold_scalar_mul_into_conv_pass import FOLD
from etfold.backends.arm._passes.lowering_target import lowering_for
from etfold.backends.arm._passes.npu_costs import per_channel_scale_into_transposed_conv
from etfold.decisions import collect_decisions
from etfold.harness.tosa_runner import quantize_for_tosa

pytest.importorskip("ethosu.vela")

from etfold.harness.vela import (  # noqa: E402
    U55,
    U85,
    ethos_u_compile_spec,
    lower_ethos_u,
    lower_module_ethos_u,
    quantize_for_ethos_u,
)

UNEVEN = torch.linspace(0.3, 3.0, 16)


class ScaledUpsampler(torch.nn.Module):
    """max_pool2d(ConvTranspose2d(x) * scale, 2): a scaled upsampler, as decoders write it."""

    def __init__(self, scale: torch.Tensor):
        super().__init__()
        self.up = torch.nn.ConvTranspose2d(16, 16, 2, stride=2)
        self.scale = torch.nn.Parameter(scale.reshape(1, -1, 1, 1).clone())

    def forward(self, x):
        return torch.nn.functional.max_pool2d(self.up(x) * self.scale, 2)


def _samples(count=4):
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(1, 16, 16, 16, generator=generator),) for _ in range(count)]


def _module(scale):
    torch.manual_seed(0)
    return ScaledUpsampler(scale).eval()


def _decisions_quantizing_for(target: str | None, scale: torch.Tensor):
    samples = _samples()
    with arm_folds_registered(), collect_decisions() as decisions:
        if target is None:
            quantize_for_tosa(_module(scale), samples[0], calibration=samples[1:])
        else:
            quantize_for_ethos_u(_module(scale), samples[0], target, calibration=samples[1:])
    return [(d.applied, d.detail) for d in decisions if d.fold == FOLD]


def test_uneven_scale_declines_into_a_transposed_conv_on_u55_saying_why():
    [(applied, detail)] = _decisions_quantizing_for(U55, UNEVEN)
    assert not applied
    assert f"on {U55} Vela requantizes a transposed conv's output in standalone passes" in detail


def test_uneven_scale_declines_into_a_transposed_conv_quantized_for_no_named_npu():
    [(applied, detail)] = _decisions_quantizing_for(None, UNEVEN)
    assert not applied
    assert detail.startswith("quantizing with no Ethos-U target named")


@pytest.mark.parametrize(
    ("target", "scale"),
    [(U85, UNEVEN), (U55, torch.full((16,), 0.5)), (None, torch.full((16,), 0.5))],
    ids=["uneven-u85", "uniform-u55", "uniform-plain-tosa"],
)
def test_folds_where_vela_fuses_the_requantization_or_shifts_stay(target, scale):
    [(applied, _)] = _decisions_quantizing_for(target, scale)
    assert applied


@pytest.mark.parametrize("target", [U55, U85])
def test_etfold_costs_no_vela_cycles_against_stock(target):
    """Folded on U55 this upsampler takes about 1.45x stock's cycles; on U85 the fold pays."""
    samples = _samples()
    module = _module(UNEVEN)
    stock = lower_module_ethos_u(module, samples[0], target, calibration=samples[1:])
    with arm_folds_registered():
        etfold = lower_module_ethos_u(module, samples[0], target, calibration=samples[1:])
    assert etfold.estimate.total_cycles <= stock.estimate.total_cycles
    if target == U85:
        assert etfold.estimate.total_cycles < stock.estimate.total_cycles


def test_quantized_with_a_tosa_quantizer_then_lowered_for_u55_costs_no_cycles():
    """The NPU is named only at lowering; folded before calibration, the upsampler's
    requantization would run as two standalone passes on U55 (conv_scale_net: 1.08x stock)."""
    samples = _samples()
    module = _module(UNEVEN)
    stock = lower_ethos_u(quantize_for_tosa(module, samples[0], calibration=samples[1:]), U55)
    with arm_folds_registered():
        quantized = quantize_for_tosa(module, samples[0], calibration=samples[1:])
        etfold = lower_ethos_u(quantized, U55)
    assert etfold.operator_counts()["MUL"] == stock.operator_counts()["MUL"] == 1
    assert etfold.estimate.total_cycles <= stock.estimate.total_cycles


class ScaledThenPermuted(torch.nn.Module):
    """residual + (Linear(x) * gamma).permute(0, 3, 1, 2): LayerScale before the permute back."""

    def __init__(self, fan_in: int = 640, fan_out: int = 160):
        super().__init__()
        self.fc = torch.nn.Linear(fan_in, fan_out)
        self.gamma = torch.nn.Parameter(torch.linspace(0.5, 1.5, fan_out))

    def forward(self, x, residual):
        return residual + self.fc(x).mul(self.gamma).permute(0, 3, 1, 2)


def _permuted_case():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(4)
    samples = [
        (
            torch.randn(1, 4, 4, 640, generator=generator),
            torch.randn(1, 160, 4, 4, generator=generator),
        )
        for _ in range(4)
    ]
    return ScaledThenPermuted().eval(), samples


def test_a_multiply_a_transpose_reads_stays_on_u85_and_costs_no_cycles():
    """Folded, this layer would write its output transposed: 14,050 -> 200,702 U85 cycles."""
    module, samples = _permuted_case()
    stock = lower_module_ethos_u(module, samples[0], U85, calibration=samples[1:])
    with arm_folds_registered(), collect_decisions() as decisions:
        etfold = lower_module_ethos_u(module, samples[0], U85, calibration=samples[1:])
    [detail] = {d.detail for d in decisions if d.fold == FOLD}
    assert detail.startswith(f"on {U85} a transpose reads the multiply")
    assert etfold.estimate.total_cycles <= stock.estimate.total_cycles


def test_a_multiply_a_transpose_reads_folds_on_u55():
    module, samples = _permuted_case()
    with arm_folds_registered(), collect_decisions() as decisions:
        quantize_for_ethos_u(module, samples[0], U55, calibration=samples[1:])
    assert [d.applied for d in decisions if d.fold == FOLD] == [True]


@settings(max_examples=40, deadline=None)
@given(
    target=st.sampled_from(["ethos-u55-64", "ethos-u55-128", "ethos-u65-256", "ethos-u85-256"]),
    values=st.lists(
        st.floats(-4, 4, allow_nan=False).filter(lambda v: abs(v) > 1e-3), min_size=1, max_size=6
    ),
)
def test_rule_declines_exactly_uneven_scales_on_the_u55_family(target, values):
    scale = torch.tensor(values, dtype=torch.float32)
    with lowering_for(ethos_u_compile_spec(target)):
        declined = per_channel_scale_into_transposed_conv(scale)
    uneven = len(set(values)) > 1
    assert (declined is not None) == (uneven and not target.startswith("ethos-u85"))
    assert per_channel_scale_into_transposed_conv(scale) is None  # no target: plain TOSA
    before_calibration = per_channel_scale_into_transposed_conv(scale, before_calibration=True)
    assert (before_calibration is not None) == uneven  # no NPU named while quantizing


@pytest.mark.long
@pytest.mark.parametrize("quantizer", ["ethos-u", "tosa"])
@pytest.mark.parametrize("target", [U55, U85])
def test_conv_scale_net_costs_no_cycles_against_stock(target, quantizer):
    """The model as its issue gave it (seed 7), quantized naming the NPU or not."""
    from etfold.demo_models.arm_conv_scale import CONV_SCALE_NET

    build, calibration = CONV_SCALE_NET
    module, inputs = build()

    def lowered():
        if quantizer == "tosa":
            quantized = quantize_for_tosa(module, inputs, calibration=calibration())
        else:
            quantized = quantize_for_ethos_u(module, inputs, target, calibration=calibration())
        return lower_ethos_u(quantized, target)

    stock = lowered()
    with arm_folds_registered():
        etfold = lowered()
    assert etfold.operator_counts()["MUL"] < stock.operator_counts()["MUL"]
    assert etfold.estimate.total_cycles <= stock.estimate.total_cycles
