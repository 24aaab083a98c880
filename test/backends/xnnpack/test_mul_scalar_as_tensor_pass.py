# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""`mul.Scalar`, written or made by attention's decomposition, joins the delegate."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.mul_scalar_as_tensor_pass import (
    FOLD,
    mul_scalars_as_tensors,
)
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.dynamic_shapes import lower_dynamic
from etfold.harness.xnnpack_runner import assert_close, eager_outputs, lower_module_xnnpack

MUL_SCALAR = "aten.mul.Scalar"


class ScaledBlock(torch.nn.Module):
    """times a number (as `mul.Scalar`) -> relu: one correctly rounded product per value."""

    def __init__(self, scalar=0.5):
        super().__init__()
        self.scalar = scalar

    def forward(self, x):
        return torch.relu(torch.ops.aten.mul.Scalar(x, self.scalar))


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.3)


def _lower(module, inputs, **lower):
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(module, inputs, [XnnpackPartitioner()], **lower)
    return program, expected, [d for d in decisions if d.fold == FOLD]


@functools.cache
def _scaled_block(dtype: torch.dtype):
    torch.manual_seed(0)
    inputs = (torch.randn(4, 8).to(dtype),)
    lower = {"lower": to_edge_transform_and_lower} if dtype != torch.float32 else {}
    return (*_lower(ScaledBlock().eval(), inputs, **lower), inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_times_a_half_joins_the_delegate_and_matches_eager_bit_for_bit(dtype):
    program, expected, decisions, inputs = _scaled_block(dtype)
    assert program.delegates() == 1 and MUL_SCALAR not in program.ops_outside()
    assert [d.applied for d in decisions] == [True]
    assert_close(program.run(*inputs), expected, atol=0, rtol=0)


def test_attention_scales_q_and_k_inside_the_delegate():
    """The mul.Scalar exists only after decomposition: the hook decomposes first."""
    torch.manual_seed(0)
    inputs = tuple(torch.randn(1, 2, 6, 8) for _ in range(3))
    program, expected, decisions = _lower(Attention().eval(), inputs)
    # the decomposition's fully-masked-row handling (eq/any/where) stays outside, as in stock
    assert MUL_SCALAR not in program.ops_outside()
    assert [d.applied for d in decisions] == [True, True]
    assert_close(program.run(*inputs), expected, atol=1e-5, rtol=1e-5)


@functools.cache
def _dynamic_attention():
    torch.manual_seed(0)
    tokens = torch.export.Dim("tokens", min=2, max=20)
    dims = tuple({2: tokens} for _ in range(3))
    inputs = tuple(torch.randn(1, 2, 6, 8) for _ in range(3))
    program, decisions = lower_dynamic(
        Attention().eval(), inputs, dims, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
    )
    return program, [d for d in decisions if d.fold == FOLD]


def test_dynamic_attention_scales_q_and_k_as_the_static_one_does():
    program, decisions = _dynamic_attention()
    assert MUL_SCALAR not in program.ops_outside()
    assert [(d.applied, d.detail) for d in decisions] == [
        (True, "times 0.5477225575051661 as a constant operand")
    ] * 2


@pytest.mark.parametrize("tokens", [2, 20], ids=["min", "max"])
def test_dynamic_attention_on_the_runtime_matches_eager_at_the_bounds(tokens):
    program, _ = _dynamic_attention()
    gen = torch.Generator().manual_seed(tokens)
    inputs = tuple(torch.randn(1, 2, tokens, 8, generator=gen) for _ in range(3))
    assert_close(program.run(*inputs), eager_outputs(Attention(), inputs), atol=1e-5, rtol=1e-5)


def _declined_by_pass(module, inputs, *, bf16=False) -> list[str]:
    """The pass on the exported program: it must come back unchanged; the reasons."""
    program = torch.export.export(module.eval(), inputs)
    before = program.graph_module.code
    with collect_decisions() as decisions:
        result = mul_scalars_as_tensors(program, None, bf16=bf16)
    assert result is program and program.graph_module.code == before
    return [d.detail for d in decisions if d.fold == FOLD and not d.applied]


def test_declines_when_xnnpack_does_not_multiply_its_dtype():
    inputs = (torch.randn(2, 8).to(torch.bfloat16),)
    (reason,) = _declined_by_pass(ScaledBlock(), inputs, bf16=False)
    assert reason.startswith("torch.bfloat16 multiply")


def test_declines_when_the_scalar_is_not_a_plain_number():
    (reason,) = _declined_by_pass(ScaledBlock(scalar=True), (torch.randn(2, 8),))
    assert "is not a plain number" in reason


def test_declines_when_the_scalar_is_not_exact_in_half_precision():
    inputs = (torch.randn(2, 8).to(torch.float16),)
    (reason,) = _declined_by_pass(ScaledBlock(scalar=0.1), inputs)
    assert "0.1 is not exact in torch.float16" in reason


def test_the_rewrite_is_a_mul_tensor_with_the_same_operands():
    program = torch.export.export(ScaledBlock(scalar=3).eval(), (torch.randn(2, 8),))
    result = mul_scalars_as_tensors(program, None, bf16=False)
    (mul,) = [n for n in result.graph.nodes if n.target == torch.ops.aten.mul.Tensor]
    assert mul.args[1] == 3 and result is not program
    assert not [n for n in program.graph.nodes if n.target == torch.ops.aten.mul.Tensor]


@settings(max_examples=2)
@given(
    rows=st.integers(1, 5),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    scalar=st.sampled_from([0.5, -2, 0.1, 3.0e-3, 1.25, 0.3]),
)
def test_generated_scales_match_eager_and_join_the_delegate_when_exact(rows, dtype, scalar):
    module = ScaledBlock(scalar=scalar).eval()
    inputs = (torch.randn(rows, 8, generator=torch.Generator().manual_seed(rows)).to(dtype),)
    program, expected, decisions = _lower(module, inputs)
    exact = dtype == torch.float32 or float(torch.tensor(scalar, dtype=dtype)) == scalar
    assert [d.applied for d in decisions] == [exact]
    assert (MUL_SCALAR in program.ops_outside()) == (not exact)
    # rewritten, the delegate rounds eager's exact product once, as eager does
    tolerance = 0 if exact else {torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    assert_close(program.run(*inputs), expected, atol=tolerance, rtol=tolerance)
