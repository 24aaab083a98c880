# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A number operand the lowering would convert on every call (an int with a float32
tensor, any number with a half one) becomes the constant that convert computes: no
constant work is left at runtime, and the program computes the same numbers."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.number_operands_as_constants_pass import (
    FOLD,
    decomposition_writes_numbers,
    number_operands_as_constants,
)
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.dynamic_pairs import LengthAxis, decisions_apart, lower_xnnpack_pair
from etfold.harness.dynamic_shapes import lower_dynamic
from etfold.harness.xnnpack_runner import assert_close, lower_module_xnnpack


class TanhGelu(torch.nn.Module):
    """GPT-2's gelu_new written out: four number operands of half binary ops; with
    `rounded`, each number is the 0-d tensor of x's dtype the lowering computes with."""

    def __init__(self, rounded: bool = False):
        super().__init__()
        self.rounded = rounded

    def forward(self, x):
        def n(number):
            return torch.tensor(number).to(x.dtype) if self.rounded else number

        inner = n(0.7978845608) * (x + n(0.044715) * (x * x * x))
        return n(0.5) * x * (n(1) + torch.tanh(inner))


class SqueezeExcite(torch.nn.Module):
    """MobileNetV3's block tail: hardswish, squeeze-excite with hardsigmoid, residual. The
    hardsigmoid's decomposition, `clamp(x + 3, 0, 6) / 6`, adds and divides by ints."""

    def __init__(self, channels: int = 16):
        super().__init__()
        self.expand = torch.nn.Conv2d(channels, 32, 1)
        self.squeeze = torch.nn.Conv2d(32, 8, 1)
        self.excite = torch.nn.Conv2d(8, 32, 1)
        self.project = torch.nn.Conv2d(32, channels, 1)

    def forward(self, x):
        h = F.hardswish(self.expand(x))
        gate = F.hardsigmoid(self.excite(F.relu(self.squeeze(F.adaptive_avg_pool2d(h, 1)))))
        return x + self.project(h * gate)


class IntOperands(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x + 3) / 6 - 1


class FloatOperands(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x + 3.0) / 6.0 - 0.5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_number_operands_become_half_constants_of_the_program(dtype):
    program = torch.export.export(TanhGelu(), (torch.randn(3, 8).to(dtype),))
    with collect_decisions() as decisions:
        rewritten = number_operands_as_constants(program, None)
    assert rewritten is not program and not program.constants
    numbers = [d for d in decisions if d.fold == FOLD]
    assert len(numbers) == 4 and all(d.applied for d in numbers)
    assert sorted(float(c) for c in rewritten.constants.values()) == sorted(
        float(torch.tensor(n).to(dtype)) for n in (0.5, 1, 0.7978845608, 0.044715)
    )
    assert all(c.dtype is dtype and c.dim() == 0 for c in rewritten.constants.values())
    x = torch.randn(3, 8).to(dtype)
    assert torch.equal(rewritten.module()(x), TanhGelu(rounded=True)(x))


def test_int_operands_of_a_float32_tensor_become_float32_constants_and_floats_stay():
    program = torch.export.export(IntOperands(), (torch.randn(3, 8),))
    with collect_decisions() as decisions:
        rewritten = number_operands_as_constants(program, None)
    assert [d.detail for d in decisions if d.fold == FOLD] == [
        "number 3 as a torch.float32 constant",
        "number 6 as a torch.float32 constant",
        "number 1 as a torch.float32 constant",
    ]
    assert sorted(float(c) for c in rewritten.constants.values()) == [1.0, 3.0, 6.0]
    x = torch.randn(3, 8)
    assert torch.equal(rewritten.module()(x), IntOperands()(x))
    floats = torch.export.export(FloatOperands(), (torch.randn(3, 8),))
    assert number_operands_as_constants(floats, None) is floats  # float32 numbers: no convert


def test_only_decompositions_that_write_such_numbers_decompose_the_program_first():
    """hardsigmoid's decomposition adds 3 and divides by 6; silu's multiplies by a sigmoid:
    a program with silu alone is handed back as it came, undecomposed."""
    from executorch.exir.program._program import _default_decomposition_table

    table = dict(_default_decomposition_table().items())

    class Activations(torch.nn.Module):
        def forward(self, x):
            return F.hardsigmoid(x), F.silu(x)

    program = torch.export.export(Activations(), (torch.randn(3),))
    hardsigmoid, silu = [n for n in program.graph.nodes if n.op == "call_function"]
    assert decomposition_writes_numbers(hardsigmoid, table)
    assert not decomposition_writes_numbers(silu, table)
    silu_only = torch.export.export(torch.nn.SiLU(), (torch.randn(3),))
    assert number_operands_as_constants(silu_only, table) is silu_only
    rewritten = number_operands_as_constants(program, table)
    ops = {n.target for n in rewritten.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.hardsigmoid.default not in ops and len(rewritten.constants) == 2


@functools.cache
def _squeeze_excite(lower: str):
    torch.manual_seed(0)
    module, inputs = SqueezeExcite().eval(), (torch.randn(1, 16, 8, 8),)
    if lower == "stock":
        program, expected = lower_module_xnnpack(module, inputs, [UpstreamXnnpackPartitioner()])
        return program, expected, inputs, ()
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(
            module, inputs, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
        )
    return program, expected, inputs, tuple(d for d in decisions if d.fold == FOLD)


def test_hardsigmoid_numbers_leave_no_convert_at_runtime_and_the_same_numbers():
    """Stock converts two int64 constants outside the delegate on every call."""
    program, expected, inputs, decisions = _squeeze_excite("etfold")
    stock, *_ = _squeeze_excite("stock")
    assert stock.constant_work_outside() and not program.constant_work_outside()
    assert program.delegates() == 1 and not program.ops_outside()
    assert len(decisions) == 2 and all(d.applied for d in decisions)
    actual = program.run(*inputs)
    assert_close(actual, stock.run(*inputs), atol=0)  # the same numbers as stock's program
    assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_no_constant_convert_runs_at_runtime(dynamic):
    """Left alone, each number would be lifted as float32 and converted on every call."""
    rows = torch.export.Dim("rows", min=2, max=16)
    module = TanhGelu()
    program, _ = lower_dynamic(
        module,
        (torch.randn(4, 8).half(),),
        ({0: rows},) if dynamic else None,
        [XnnpackPartitioner()],
        lower=to_edge_transform_and_lower,
    )
    assert not program.constant_work_outside()
    for n in (2, 9, 16) if dynamic else (4,):
        x = torch.randn(n, 8).half()
        assert_close(program.run(x), [module(x.float()).half()], atol=4e-3, rtol=4e-3)


def _rows(length: int) -> tuple[torch.Tensor]:
    return (torch.randn(length, 8, generator=torch.Generator().manual_seed(length)),)


@pytest.mark.long
def test_a_dynamic_length_lifts_the_numbers_the_static_one_does_at_every_bound():
    pair = lower_xnnpack_pair(IntOperands, _rows, LengthAxis(((0,),), 1, 32, 4))
    assert decisions_apart(pair, lambda fold: fold == FOLD) == ({}, {})
    assert len([d for d in pair.dynamic.decisions if d.fold == FOLD]) == 3
    for lowered in (pair.static, pair.dynamic):
        assert not lowered.program.constant_work_outside() and lowered.program.delegates() == 1
    for length in pair.length.checked():
        inputs = _rows(length)
        assert_close(pair.dynamic.program.run(*inputs), [IntOperands()(*inputs)], atol=1e-6)


@pytest.mark.long
@settings(max_examples=4)
@given(
    number=st.sampled_from([3, -2, 7, 0.5, 0.1, 1e-3]),
    op=st.sampled_from(["add", "sub", "mul", "div"]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
)
def test_generated_number_operands_compute_what_stock_computes(number, op, dtype):
    class Binary(torch.nn.Module):
        def forward(self, x):
            return torch.relu(getattr(torch, op)(torch.relu(x), number))

    inputs = (torch.randn(3, 8, generator=torch.Generator().manual_seed(3)).to(dtype),)
    program, expected = lower_module_xnnpack(
        Binary(), inputs, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
    )
    stock, _ = lower_module_xnnpack(Binary(), inputs, [UpstreamXnnpackPartitioner()])
    assert not program.constant_work_outside()
    assert_close(program.run(*inputs), stock.run(*inputs), atol=0)
    tolerance = 0 if dtype == torch.float32 else 2e-3
    assert_close(program.run(*inputs), expected, atol=tolerance, rtol=tolerance)
