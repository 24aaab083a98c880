# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""`pow(x, 3)` and `pow(x, 4)` run in the delegate as multiplies: the float32 cube bit
for bit eager's (XNNPACK's flushed subnormals aside), within the stated ulps elsewhere;
GPT-2's `gelu_new` joins one delegate."""

from __future__ import annotations

import functools

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.pow_of_small_integer_as_multiplies_pass import (
    FOLD,
    pows_of_small_integers_as_multiplies,
)
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.dynamic_pairs import (
    LengthAxis,
    decisions_apart,
    dynamic_errors,
    lower_xnnpack_pair,
)
from etfold.harness.xnnpack_runner import assert_close, lower_module_xnnpack

POW = "aten.pow.Tensor_Scalar"


class Powers(torch.nn.Module):
    def __init__(self, exponents=(3, 4)):
        super().__init__()
        self.exponents = exponents

    def forward(self, x):
        x = x * 1.0  # a delegated op before the powers
        return tuple(torch.pow(x, n) for n in self.exponents)


class GeluNew(torch.nn.Module):
    """GPT-2 / ALBERT's MLP with `gelu_new`."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)

    def forward(self, x):
        h = self.up(x)
        h = 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.down(h)


def _values(rows: int = 64) -> torch.Tensor:
    """Normals over many scales, and zeros, infinities, NaN, subnormals."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=gen) * torch.logspace(-20, 12, 64)
    x[0, :8] = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -3e-39, 1]
    )
    return x


TRACED = 16
POWERS_LENGTH = LengthAxis(((0,),), 1, 64, TRACED)


def _rows(length: int) -> tuple[torch.Tensor]:
    return (_values(length),)


@functools.cache
def _powers_pair():
    return lower_xnnpack_pair(Powers, _rows, POWERS_LENGTH)


@functools.cache
def _powers(dtype: torch.dtype, partitioner: str):
    inputs = (_values(TRACED).to(dtype),)
    if partitioner == "stock":
        return lower_module_xnnpack(Powers(), inputs, [UpstreamXnnpackPartitioner()]), ()
    with collect_decisions() as decisions:
        lowered = lower_module_xnnpack(
            Powers(), inputs, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
        )
    return lowered, tuple(d for d in decisions if d.fold == FOLD)


def _ulps(actual: torch.Tensor, expected: torch.Tensor) -> int:
    """The largest distance in units in the last place between two results, NaN, infinities
    and signs compared exactly; a subnormal eager result may come back 0 (XNNPACK flushes
    subnormals, in every op), and counts as exact when it does."""
    assert torch.equal(actual.isnan(), expected.isnan())
    infinite = expected.isinf()
    assert torch.equal(actual[infinite], expected[infinite])
    tiny = torch.finfo(expected.dtype).tiny
    flushed = (expected.abs() < tiny) & (actual == 0)
    compared = ~expected.isnan() & ~infinite & ~flushed
    bits = {4: torch.int32, 2: torch.int16}[actual.element_size()]
    a, e = actual[compared].view(bits).long(), expected[compared].view(bits).long()
    return int((a - e).abs().max()) if a.numel() else 0


def test_float32_powers_run_in_the_delegate_the_cube_bit_for_bit_eager():
    static = _powers_pair().static
    program, decisions = static.program, [d for d in static.decisions if d.fold == FOLD]
    (stock, _), _ = _powers(torch.float32, "stock")
    assert stock.ops_outside()[POW] == 2
    assert program.delegates() == 1 and not program.ops_outside()
    assert [d.detail for d in decisions] == ["x ** 3 as multiplies", "x ** 4 as multiplies"]
    cube, fourth = program.run(*_rows(TRACED))
    expected = Powers()(*_rows(TRACED))
    assert _ulps(cube, expected[0]) == 0 and _ulps(fourth, expected[1]) <= 2
    # the unrewritten program's portable pow computes with std::pow: 1 ulp off eager
    assert _ulps(cube, stock.run(*_rows(TRACED))[0]) <= 1


def test_float16_powers_are_within_their_ulps():
    (program, expected), decisions = _powers(torch.float16, "etfold")
    assert [d.applied for d in decisions] == [True, True] and not program.ops_outside()
    cube, fourth = program.run(_values(TRACED).half())
    assert _ulps(cube, expected[0]) <= 1 and _ulps(fourth, expected[1]) <= 2


def test_gelu_new_joins_one_delegate():
    torch.manual_seed(0)
    inputs = (torch.randn(2, 5, 16),)
    program, expected = lower_module_xnnpack(
        GeluNew(), inputs, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
    )
    assert program.delegates() == 1 and not program.ops_outside()
    assert_close(program.run(*inputs), expected, atol=1e-5, rtol=1e-5)


def test_a_dynamic_length_writes_the_powers_the_static_one_does_at_every_bound():
    pair = _powers_pair()
    assert decisions_apart(pair, lambda fold: fold == FOLD) == ({}, {})
    assert pair.static.program.delegates() == pair.dynamic.program.delegates() == 1
    assert not pair.dynamic.program.ops_outside()
    for length in pair.length.checked():
        actual = pair.dynamic.program.run(*_rows(length))
        expected = Powers()(*_rows(length))
        assert max(_ulps(a, e) for a, e in zip(actual, expected, strict=True)) <= 2
    assert set(dynamic_errors(pair)) >= {1, 64}


def _declined_by_pass(module, inputs) -> list[str]:
    """The pass on the exported program: it must come back unchanged; the reasons."""
    program = torch.export.export(module.eval(), inputs)
    before = program.graph_module.code
    with collect_decisions() as decisions:
        result = pows_of_small_integers_as_multiplies(program, bf16=False)
    assert result is program and program.graph_module.code == before
    return [d.detail for d in decisions if d.fold == FOLD and not d.applied]


def test_declines_when_the_exponent_is_not_an_integer():
    (reason,) = _declined_by_pass(Powers((2.5,)), (torch.randn(4),))
    assert reason == "exponent 2.5 is not an integer"


def test_declines_when_the_exponent_is_negative():
    (reason,) = _declined_by_pass(Powers((-1,)), (torch.randn(4),))
    assert reason.startswith("exponent -1: 1 / x would run on XNNPACK, which flushes")


def test_declines_when_the_exponent_is_past_the_bound():
    (reason,) = _declined_by_pass(Powers((5,)), (torch.randn(4),))
    assert reason == "exponent 5: only 3, 4 are written as multiplies"


def test_declines_when_xnnpack_cannot_compile_its_dtype():
    (reason,) = _declined_by_pass(Powers((3,)), (torch.randn(4).double(),))
    assert reason.startswith("torch.float64 power")


def test_declines_when_the_input_is_quantized():
    class Dequantized(torch.nn.Module):
        def forward(self, q):
            x = torch.ops.quantized_decomposed.dequantize_per_tensor(
                q, 0.1, 0, -128, 127, torch.int8
            )
            return torch.pow(x, 3)

    inputs = (torch.randint(-128, 127, (3, 4), dtype=torch.int8),)
    (reason,) = _declined_by_pass(Dequantized(), inputs)
    assert reason.startswith("quantized input")


def test_the_square_is_left_to_upstream_and_nothing_is_declined():
    assert _declined_by_pass(Powers((2,)), (torch.randn(4),)) == []


@pytest.mark.long
@settings(max_examples=4)
@given(
    exponent=st.sampled_from([3, 4, 3.0]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    rows=st.integers(1, 8),
)
def test_generated_powers_match_eager_and_stock_within_their_ulps(exponent, dtype, rows):
    module = Powers((exponent,))
    inputs = (_values(rows).to(dtype),)
    program, expected = lower_module_xnnpack(
        module, inputs, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
    )
    stock, _ = lower_module_xnnpack(module, inputs, [UpstreamXnnpackPartitioner()])
    assert not program.ops_outside()
    bound = {3: 0 if dtype == torch.float32 else 1, 4: 2}[int(exponent)]
    assert _ulps(program.run(*inputs)[0], expected[0]) <= bound
    assert _ulps(program.run(*inputs)[0], stock.run(*inputs)[0]) <= bound + 1  # std::pow
