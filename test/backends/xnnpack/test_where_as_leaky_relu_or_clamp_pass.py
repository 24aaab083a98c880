# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A `where` selecting x or a function of x by x's sign or a bound is one XNNPACK op
(leaky ReLU, clamp), bit for bit eager's on NaN, infinities and zeros; the forms whose
NaN differs are declined."""

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
from etfold.backends.xnnpack._passes.where_as_leaky_relu_or_clamp_pass import (
    FOLD,
    wheres_as_leaky_relu_or_clamp,
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

SPECIAL = [float("nan"), 0.0, -0.0, float("inf"), -float("inf"), 0.5, 2.0, -1e-30, 1e30]


class Wheres(torch.nn.Module):
    """Each form the pass writes as one op, after a linear (a delegate to join)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        x = torch.cat([self.linear(x), x], dim=-1)  # x's own values (NaN, zeros) pass through
        return (
            torch.where(x > 0, x, 0.1 * x),
            torch.where(x >= 0, x, x * 0.25),
            torch.where(x < 0, -0.5 * x, x),
            torch.where(x <= 0, x * 3, x),
            torch.where(x < 0.5, 0.5, x),
            torch.where(x > 2, torch.full_like(x, 2.0), x),
            torch.where(x <= 0, torch.zeros_like(x), x),
        )


def _inputs(rows: int = 2) -> tuple[torch.Tensor]:
    x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(rows))
    x[0, : len(SPECIAL) - 1] = torch.tensor(SPECIAL[:-1])
    return (x,)


ROWS = LengthAxis(((0,),), 1, 16, 4)


def _rows(length: int) -> tuple[torch.Tensor]:
    return _inputs(length)


@functools.cache
def _wheres_pair():
    return lower_xnnpack_pair(Wheres, _rows, ROWS)


def test_each_form_is_one_op_in_the_delegate_bit_for_bit_eager_and_stock():
    pair = _wheres_pair()
    program, decisions = pair.static.program, [d for d in pair.static.decisions if d.fold == FOLD]
    inputs = _rows(ROWS.traced)
    torch.manual_seed(0)  # the pair's weights
    stock, expected = lower_module_xnnpack(Wheres(), inputs, [UpstreamXnnpackPartitioner()])
    assert stock.ops_outside()["aten.where.self"] == 7
    assert program.delegates() == 1 and not program.ops_outside()
    assert len(decisions) == 7 and all(d.applied for d in decisions)
    assert [d.detail.split(" as ")[1].split("(")[0] for d in decisions] == [
        *["leaky_relu"] * 4,
        *["clamp"] * 3,
    ]
    actual = program.run(*inputs)
    # the selects bit for bit stock's (the same delegated linear before them), NaN where
    # its NaN, a zero's sign aside; eager's linear rounds its sums in another order
    assert_close(actual, stock.run(*inputs), atol=0)
    assert_close(actual, expected, atol=1e-6, rtol=1e-6)


def test_the_rewrite_is_leaky_relu_with_the_slope_and_the_comparison_goes():
    class Leaky(torch.nn.Module):
        def forward(self, x):
            return torch.where(x > 0, x, 0.1 * x)

    program = torch.export.export(Leaky(), (torch.randn(4),))
    rewritten = wheres_as_leaky_relu_or_clamp(program, bf16=False)
    ops = [n for n in rewritten.graph.nodes if n.op == "call_function"]
    assert [n.target for n in ops] == [torch.ops.aten.leaky_relu.default]
    assert ops[0].args[1] == 0.1
    assert len([n for n in program.graph.nodes if n.op == "call_function"]) == 3


def test_a_dynamic_length_writes_the_forms_the_static_one_does_at_every_bound():
    pair = _wheres_pair()
    assert decisions_apart(pair, lambda fold: fold == FOLD) == ({}, {})
    assert pair.static.program.delegates() == pair.dynamic.program.delegates() == 1
    assert not pair.dynamic.program.ops_outside()
    errors = dynamic_errors(pair)
    assert set(errors) >= {1, 16} and len(errors) == 4 and max(errors.values()) <= 1e-5


def _declined_by_pass(module, inputs) -> list[str]:
    """The pass on the exported program: it must come back unchanged; the reasons."""
    program = torch.export.export(module.eval(), inputs)
    before = program.graph_module.code
    with collect_decisions() as decisions:
        result = wheres_as_leaky_relu_or_clamp(program, bf16=False)
    assert result is program and program.graph_module.code == before
    return [d.detail for d in decisions if d.fold == FOLD and not d.applied]


class Where(torch.nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, x):
        return self.form(x)


def test_declines_when_a_nan_x_would_give_the_bound():
    (reason,) = _declined_by_pass(Where(lambda x: torch.where(x > 0.5, x, 0.5)), _inputs())
    assert reason == "where(x > 0.5, x, 0.5) gives 0.5 for a NaN x; clamp and maximum give NaN"


def test_declines_when_it_selects_between_two_tensors():
    def maximum(x):
        y = x.flip(0)
        return torch.where(x > y, x, y)

    (reason,) = _declined_by_pass(Where(maximum), _inputs())
    assert "gives the second for a NaN first" in reason


def test_declines_when_a_number_is_not_a_value_of_a_half_dtype():
    inputs = (torch.randn(2, 8).half(),)
    (reason,) = _declined_by_pass(Where(lambda x: torch.where(x > 0, x, 0.1 * x)), inputs)
    assert reason.startswith("0.1 is not a torch.float16 value")


def test_declines_when_a_clamp_form_would_lose_nan_in_float16():
    inputs = (torch.randn(2, 8).half(),)
    (reason,) = _declined_by_pass(Where(lambda x: torch.where(x < 0.5, 0.5, x)), inputs)
    assert reason.startswith("XNNPACK's torch.float16 clamp gives a bound for NaN")


def test_declines_when_xnnpack_cannot_compile_its_dtype():
    inputs = (torch.randn(2, 8).double(),)
    (reason,) = _declined_by_pass(Where(lambda x: torch.where(x > 0, x, 0.5 * x)), inputs)
    assert reason.startswith("torch.float64 leaky_relu")


def test_declines_when_the_where_has_another_dtype_than_x():
    def widened(x):
        return torch.where(x < 0.5, torch.full_like(x, 0.5, dtype=torch.float32), x)

    (reason,) = _declined_by_pass(Where(widened), (torch.randn(2, 8).half(),))
    assert reason == "the where gives torch.float32, its input is torch.float16"


def test_declines_when_the_input_is_quantized():
    def dequantized(q):
        x = torch.ops.quantized_decomposed.dequantize_per_tensor(q, 0.1, 0, -128, 127, torch.int8)
        return torch.where(x > 0, x, 0.5 * x)

    inputs = (torch.randint(-128, 127, (3, 4), dtype=torch.int8),)
    (reason,) = _declined_by_pass(Where(dequantized), inputs)
    assert reason.startswith("quantized input")


@pytest.mark.long
@settings(max_examples=4)
@given(
    form=st.sampled_from(["gt", "ge", "lt", "le", "clamp_min", "clamp_max"]),
    number=st.sampled_from([0.0, 0.25, -2.0, 0.1]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
)
def test_generated_wheres_match_eager_and_stock(form, number, dtype):
    def where(x):
        if form in ("gt", "ge"):
            return torch.where(getattr(x, form)(0), x, number * x)
        if form in ("lt", "le"):
            return torch.where(getattr(x, form)(0), x * number, x)
        if form == "clamp_min":
            return torch.where(x < number, number, x)
        return torch.where(x > number, torch.full_like(x, number), x)

    module = Where(lambda x: where(x * 2))
    inputs = tuple(x.to(dtype) for x in _inputs(3))
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(
            module, inputs, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
        )
    stock, _ = lower_module_xnnpack(module, inputs, [UpstreamXnnpackPartitioner()])
    half = dtype == torch.float16
    taken = not half or (number != 0.1 and not form.startswith("clamp"))
    assert [d.applied for d in decisions if d.fold == FOLD] == [taken]
    assert ("aten.where.self" in program.ops_outside()) == (not taken)
    assert_close(program.run(*inputs), expected, atol=0)
    assert_close(program.run(*inputs), stock.run(*inputs), atol=0)
