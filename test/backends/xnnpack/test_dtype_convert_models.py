# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Mixed-precision models with their converts delegated, run on the XNNPACK runtime."""

from __future__ import annotations

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from executorch.exir import EdgeCompileConfig

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.dtype_convert_match import (
    FOLD,
    float_converts_outside_delegates,
)
from etfold.decisions import collect_decisions
from etfold.demo_models.mixed_precision_decoders import tiny_gemma3, tiny_llama, token_ids
from etfold.harness.xnnpack_runner import lower_module_xnnpack, max_abs_error

NARROW = [torch.bfloat16, torch.float16]
SKIP_DIM_ORDER = EdgeCompileConfig(_skip_dim_order=True)
NARROW_IDS = ["bf16", "fp16"]


def _lower(module, inputs, **kwargs):
    partitioner = XnnpackPartitioner(enable_bf16=True, fold_weights=False)
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(module, inputs, [partitioner], **kwargs)
    applied = [d for d in decisions if d.fold == FOLD and d.applied]
    return program, expected, applied


class ConvInFp32(torch.nn.Module):
    """narrow -> fp32 -> channels-last conv -> narrow."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.float()).to(self.dtype)


@pytest.mark.parametrize(
    "compile_config", [None, SKIP_DIM_ORDER], ids=["dim_order", "skip_dim_order"]
)
@pytest.mark.parametrize("dtype", NARROW, ids=NARROW_IDS)
def test_channels_last_conv_between_converts_matches_eager_fp32_inside(dtype, compile_config):
    torch.manual_seed(0)
    module = ConvInFp32(dtype).eval()
    x = (3 * torch.randn(1, 4, 9, 7)).to(dtype)
    program, (expected,), applied = _lower(module, (x,), compile_config=compile_config)
    assert program.delegates() == 1 and not program.ops_outside()
    assert len(applied) == 2
    (actual,) = program.run(x)
    assert actual.dtype == dtype and actual.shape == expected.shape
    # one rounding of an fp32 conv that sums in another order: at most one ulp apart
    ulp = torch.finfo(dtype).eps * expected.float().abs().clamp_min(1e-3)
    assert ((actual.float() - expected.float()).abs() <= ulp).all()
    # a layout mix-up would permute values: most land on exactly the same number
    assert (actual == expected).float().mean() > 0.9


class RMSNormBlock(torch.nn.Module):
    """A bf16 block whose RMSNorm runs in fp32 (Llama-style), then a bf16 projection."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.up = torch.nn.Linear(width, width)
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(width))
        self.down = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.down(self.weight * h.to(x.dtype))


def test_rmsnorm_in_fp32_inside_a_bf16_block():
    torch.manual_seed(0)
    module = RMSNormBlock().to(torch.bfloat16).eval()
    x = torch.randn(4, 32).to(torch.bfloat16)
    program, (expected,), applied = _lower(module, (x,))
    assert [d.detail for d in applied] == ["bfloat16 -> float32", "float32 -> bfloat16"]
    assert float_converts_outside_delegates(program.edge.exported_program()) == {}
    (actual,) = program.run(x)
    torch.testing.assert_close(actual, expected, atol=4e-2, rtol=2e-2)


DECODERS = {"gemma3": tiny_gemma3, "llama": tiny_llama}
# logits spread wide enough that argmax is decided by the model, not by rounding
DECODER_SIZE = dict(hidden=64, vocab=64, layers=1, initializer_range=0.3)


# The llama in bf16 in `make test` (the gemma3 in fp16 lowers there too, through the
# report's row in test_ops_outside_are_explained); the other pairings in `make test-long`.
DECODER_CASES = [
    pytest.param("llama", torch.bfloat16, id="llama-bf16"),
    pytest.param("gemma3", torch.float16, id="gemma3-fp16", marks=pytest.mark.long),
    pytest.param("llama", torch.float16, id="llama-fp16", marks=pytest.mark.long),
    pytest.param("gemma3", torch.bfloat16, id="gemma3-bf16", marks=pytest.mark.long),
]


@pytest.mark.parametrize("name, dtype", DECODER_CASES)
def test_tiny_decoder_matches_eager_in_its_own_dtype(name, dtype):
    module = DECODERS[name](dtype, **DECODER_SIZE)
    ids = token_ids(DECODER_SIZE["vocab"], 8)
    program, (expected,), applied = _lower(module, (ids,))
    assert applied, "the decoder's activation converts must be delegated"
    converts = float_converts_outside_delegates(program.edge.exported_program())
    assert converts["activation"] == 0, converts
    (actual,) = program.run(ids)
    assert actual.dtype == dtype
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))
    scale = float(expected.float().abs().max())
    tolerance = (2.0**-5 if dtype == torch.bfloat16 else 2.0**-8) * scale
    error = max_abs_error([actual], [expected])
    if error > tolerance:  # XNNPACK's half-precision GEMMs round unlike eager: no worse than stock
        stock, _ = lower_module_xnnpack(
            module, (ids,), [UpstreamXnnpackPartitioner(enable_bf16=True)]
        )
        assert error <= max_abs_error(stock.run(ids), [expected])


class ConstantAndActivationInOneDelegate(torch.nn.Module):
    """One delegate computes both a table from a buffer and an activation; the table is cast after."""

    def __init__(self):
        super().__init__()
        self.register_buffer("freq", torch.linspace(0.1, 1.0, 8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = (self.freq * 3).sin()
        return table.to(torch.float16), (x * 2).to(torch.bfloat16)


def test_convert_classification_sees_through_delegates():
    """After lowering, a cast of a delegate output is "constant" when only constants reach it."""
    x = torch.randn(8)
    program, expected, applied = _lower(ConstantAndActivationInOneDelegate(), (x,))
    assert program.delegates() == 1
    assert [d.detail for d in applied] == ["float32 -> bfloat16"]
    assert float_converts_outside_delegates(program.edge.exported_program()) == {"constant": 1}
    for actual, reference in zip(program.run(x), expected, strict=True):
        torch.testing.assert_close(actual, reference, atol=1e-3, rtol=1e-2)


def test_report_models_are_the_tiny_gemma3_and_llama_in_bf16_and_fp16():
    from etfold.demo_models.mixed_precision_decoders import MODELS

    built = {m.name: (m.backend, m.build()) for m in MODELS}
    names = [f"{model}_tiny_{dtype}" for model in ("gemma3", "llama") for dtype in ("bf16", "fp16")]
    assert set(built) == set(names)
    for name in names:
        dtype = torch.bfloat16 if name.endswith("bf16") else torch.float16
        backend, (module, (ids,)) = built[name]
        assert backend == "xnnpack" and ids.shape == (1, 32)
        assert {p.dtype for p in module.parameters()} == {dtype}
        with torch.no_grad():
            assert module(ids).shape == (1, 32, 1000)


class RoundTrip(torch.nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 3).to(self.dtype).to(torch.float32) * 2


@pytest.mark.parametrize(
    "compile_config", [None, SKIP_DIM_ORDER], ids=["dim_order", "skip_dim_order"]
)
@pytest.mark.parametrize("dtype", NARROW, ids=NARROW_IDS)
def test_back_to_back_converts_are_not_removed_as_redundant(dtype, compile_config):
    """fp32 -> narrow -> fp32 rounds; dropping the pair as a no-op copy would not."""
    x = torch.randn(4, 16) + 1
    program, (expected,), applied = _lower(RoundTrip(dtype), (x,), compile_config=compile_config)
    assert program.delegates() == 1
    assert [d.detail for d in applied] == [
        f"float32 -> {str(dtype)[6:]}",
        f"{str(dtype)[6:]} -> float32",
    ]
    # only the int64 -> float32 casts of the lifted scalars 3 and 2 stay outside
    assert float_converts_outside_delegates(program.edge.exported_program())["activation"] == 0
    (actual,) = program.run(x)
    assert torch.equal(actual, expected)
    assert not torch.equal(actual, x * 6)
