# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A `scalar_tensor` becomes the 0-d constant it makes, the same bits, so no scalar op
runs outside the delegates on every call (attention's boolean mask conversion)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.scalar_tensor_as_constant_pass import (
    FOLD,
    scalar_tensors_as_constants,
)
from etfold.decisions import collect_decisions

SCALAR_TENSOR = torch.ops.aten.scalar_tensor.default


class Scaled(torch.nn.Module):
    def __init__(self, number, dtype):
        super().__init__()
        self.number, self.dtype = number, dtype

    def forward(self, x):
        return x * torch.scalar_tensor(self.number, dtype=self.dtype)


def _rewritten(program, table=None):
    with collect_decisions() as decisions:
        rewritten = scalar_tensors_as_constants(program, table)
    return rewritten, [(d.applied, d.detail) for d in decisions if d.fold == FOLD]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.view(-1).view(torch.uint8).equal(b.view(-1).view(torch.uint8))
    )


@settings(max_examples=10)
@given(
    number=st.one_of(
        st.floats(allow_nan=False, width=32),
        st.sampled_from([math.inf, -math.inf, -0.0]),
        st.integers(-1000, 1000),
    ),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64]),
)
def test_the_constant_is_the_scalar_tensor(number, dtype):
    if dtype is torch.int64 and not isinstance(number, int):
        number = 7
    program = torch.export.export(Scaled(number, dtype), (torch.ones(3, dtype=dtype),))
    rewritten, decisions = _rewritten(program)
    assert [applied for applied, _ in decisions] == [True]
    assert SCALAR_TENSOR not in {n.target for n in rewritten.graph.nodes}
    (constant,) = rewritten.constants.values()
    assert _same_bits(constant, torch.scalar_tensor(number, dtype=dtype))
    x = torch.arange(3).to(dtype)
    expected, actual = program.module()(x), rewritten.module()(x)
    torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True)
    assert SCALAR_TENSOR in {n.target for n in program.graph.nodes}  # the user's is untouched


def test_attentions_boolean_mask_conversion_reads_constants():
    class Masked(torch.nn.Module):
        def forward(self, q, mask):
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    inputs = (torch.randn(1, 2, 5, 4), torch.rand(5, 5) > 0.5)
    program = torch.export.export(Masked(), inputs)
    table = XnnpackPartitioner()._decomposition_table(program)
    rewritten, decisions = _rewritten(program, table)
    numbers = sorted(detail.split(" ")[0] for _, detail in decisions)
    assert numbers == ["-inf", "0.0"]
    assert SCALAR_TENSOR not in {n.target for n in rewritten.graph.nodes}


def test_declines_when_the_tensor_is_not_a_plain_cpu_tensor():
    program = torch.export.export(Scaled(2.0, torch.float32), (torch.ones(3),))
    (node,) = [n for n in program.graph.nodes if n.target is SCALAR_TENSOR]
    node.kwargs = {**node.kwargs, "pin_memory": True}
    code = program.graph_module.code
    rewritten, decisions = _rewritten(program)
    assert rewritten is program and program.graph_module.code == code
    assert decisions == [(False, "pin_memory=True: not a plain CPU tensor")]


class OfLength(torch.nn.Module):
    def forward(self, x):
        return x * torch.scalar_tensor(x.shape[0])


def test_declines_when_the_number_is_computed_by_the_program():
    length = torch.export.Dim("length", min=2, max=8)
    program = torch.export.export(OfLength(), (torch.ones(3),), dynamic_shapes=({0: length},))
    code = program.graph_module.code
    rewritten, decisions = _rewritten(program)
    assert rewritten is program and program.graph_module.code == code
    ((applied, detail),) = decisions
    assert not applied and detail.endswith("a number known only when the program runs")
