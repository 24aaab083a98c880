# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Delegated float converts against torch, bit by bit, on the XNNPACK runtime.

Every fp16 and bf16 bit pattern is widened; fp32 sources are special values,
round-to-nearest-even probes and random bit patterns. Both edge forms are
covered: `_to_dim_order_copy` (default) and `_to_copy` (`_skip_dim_order=True`).
"""

from __future__ import annotations

import pytest
import torch
from executorch.exir import EdgeCompileConfig

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.decisions import collect_decisions
from etfold.harness.xnnpack_runner import lower_module_xnnpack

FP32_TO_NARROW = [(torch.float32, torch.float16), (torch.float32, torch.bfloat16)]
NARROW_TO_FP32 = [(torch.float16, torch.float32), (torch.bfloat16, torch.float32)]
EDGE_FORMS = {
    "to_dim_order_copy": EdgeCompileConfig(),
    "skip_dim_order_to_copy": EdgeCompileConfig(_skip_dim_order=True),
}
COPY_OP = {"to_dim_order_copy": "_to_dim_order_copy", "skip_dim_order_to_copy": "_to_copy"}


class Convert(torch.nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _fp32_probes() -> torch.Tensor:
    special = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan")]
    subnormal_fp32 = [1e-40, -1e-40, 1.4e-45, -1.4e-45, 1.1754942e-38, -5.9e-39]
    subnormal_fp16 = [3e-6, -3e-6, 6e-8, 2.98e-8, 8.9e-8]
    large = [70000.0, -70000.0, 65504.0, 65519.0, 65520.0, -65520.0, 3.4e38]
    ties = []
    for mantissa_bits in (7, 10):  # bf16 and fp16 keep 7 and 10 fraction bits
        ulp = 2.0**-mantissa_bits
        ties += [1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), 1 + ulp / 2 + 2.0**-22]
        ties += [2**-14 * (1 + ulp / 2), 1024 * (1 + 3 * ulp / 2)]
    random_bits = torch.randint(
        -(2**31), 2**31 - 1, (4096,), dtype=torch.int32, generator=torch.Generator().manual_seed(0)
    ).view(torch.float32)
    values = torch.tensor(special + subnormal_fp32 + subnormal_fp16 + large + ties)
    return torch.cat([values, random_bits])


def _every_16_bit_pattern(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def _fp32_subnormal(x: torch.Tensor) -> torch.Tensor:
    return (x != 0) & (x.abs() < torch.finfo(torch.float32).tiny)


def _assert_ties_round_to_even(x, actual, mantissa_bits):
    """1 + ulp/2 rounds down to 1 (even), 1 + 3 ulp/2 rounds up to 1 + 2 ulp (even)."""
    ulp = 2.0**-mantissa_bits
    ties = torch.tensor([1 + ulp / 2, 1 + 3 * ulp / 2])
    positions = [int((x == t).nonzero()[0]) for t in ties]
    assert actual[positions].float().tolist() == [1.0, 1 + 2 * ulp]


def _lower(source, target, form):
    x = _every_16_bit_pattern(source) if source != torch.float32 else _fp32_probes()
    with collect_decisions() as decisions:
        program, (expected,) = lower_module_xnnpack(
            Convert(target),
            (x,),
            [XnnpackPartitioner(enable_bf16=True, fold_weights=False)],
            compile_config=EDGE_FORMS[form],
        )
    return program, x, expected, decisions


def _assert_one_delegated_convert(program, decisions, source, target):
    assert program.delegates() == 1
    assert not program.ops_outside(), program.ops_outside()
    applied = [d for d in decisions if d.fold == "xnnpack.delegate_dtype_convert" and d.applied]
    assert [d.detail for d in applied] == [f"{source} -> {target}".replace("torch.", "")]


@pytest.mark.parametrize("form", EDGE_FORMS)
@pytest.mark.parametrize("source,target", NARROW_TO_FP32, ids=["fp16_fp32", "bf16_fp32"])
def test_widening_every_bit_pattern_is_bit_identical(source, target, form):
    program, x, expected, decisions = _lower(source, target, form)
    _assert_one_delegated_convert(program, decisions, source, target)
    (actual,) = program.run(x)
    assert actual.dtype == target
    assert torch.equal(_bits(actual), _bits(expected))


def test_fp32_to_fp16_is_bit_identical_including_nan_and_overflow():
    for form in EDGE_FORMS:
        program, x, expected, decisions = _lower(torch.float32, torch.float16, form)
        _assert_one_delegated_convert(program, decisions, torch.float32, torch.float16)
        (actual,) = program.run(x)
        assert actual.dtype == torch.float16
        assert torch.equal(_bits(actual), _bits(expected)), form
        assert torch.isinf(actual[x.abs() >= 65520]).all()
        _assert_ties_round_to_even(x, actual, mantissa_bits=10)


@pytest.mark.parametrize("form", EDGE_FORMS)
def test_fp32_to_bf16_matches_torch_except_flushed_fp32_subnormals(form):
    """Bit for bit torch's, but where an fp32 subnormal may be flushed to a zero of its
    sign: CPUs with a native bf16 convert (AVX-512 BF16) treat subnormal inputs as zero,
    others round them as torch does. Either is allowed; nothing else may differ."""
    program, x, expected, decisions = _lower(torch.float32, torch.bfloat16, form)
    _assert_one_delegated_convert(program, decisions, torch.float32, torch.bfloat16)
    (actual,) = program.run(x)
    assert actual.dtype == torch.bfloat16

    nan = torch.isnan(x)
    # torch does not fix a NaN payload (its scalar and vector paths differ); NaN stays NaN
    assert torch.isnan(actual[nan]).all() and torch.isnan(expected[nan]).all()

    differs = (_bits(actual) != _bits(expected)) & ~nan
    may_flush = _fp32_subnormal(x) & (expected != 0)
    assert may_flush.sum() >= 4, "the probes must include subnormals torch keeps"
    assert not (differs & ~may_flush).any(), x[differs & ~may_flush]
    assert (actual[differs] == 0).all()
    assert torch.equal(torch.signbit(actual[differs]), torch.signbit(x[differs]))
    _assert_ties_round_to_even(x, actual, mantissa_bits=7)
