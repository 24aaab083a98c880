# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A split (a fused QKV projection's, a chunked half's) runs inside the delegate as slices."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.split_as_slices_pass import FOLD, splits_as_slices
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.xnnpack_runner import lower_module_xnnpack

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SPLIT_OPS = ("aten.split_with_sizes_copy.default", "aten.split_copy.Tensor")


class Pieces(torch.nn.Module):
    """Split then chunk, the pieces reordered: every op exact, so the runtime equals eager."""

    def __init__(self, sizes=(3, 5, 8), dim=-1):
        super().__init__()
        self.sizes, self.dim = list(sizes), dim

    def forward(self, x):
        parts = (x * x).split(self.sizes, self.dim)
        first, second = torch.chunk(parts[-1] + parts[-1], 2, self.dim)
        return torch.cat([second, *parts[:-1], first], self.dim)


def _lower(module, inputs, upstream_entry_point=False):
    lower = {} if upstream_entry_point else {"lower": to_edge_transform_and_lower}
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(module, inputs, [XnnpackPartitioner()], **lower)
    return program, expected, [d for d in decisions if d.fold == FOLD]


@functools.cache
def _lowered(dtype, upstream_entry_point):
    inputs = (torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0)).to(dtype),)
    return (*_lower(Pieces().eval(), inputs, upstream_entry_point), inputs)


@pytest.mark.parametrize(
    ("dtype", "upstream_entry_point"),
    [
        (torch.float32, False),
        (torch.float16, False),
        (torch.bfloat16, False),
        (torch.float32, True),
    ],
    ids=["fp32", "fp16", "bf16", "fp32-upstream_entry_point"],
)
def test_split_and_chunk_join_the_delegate_bit_for_bit(dtype, upstream_entry_point):
    program, expected, decisions, inputs = _lowered(dtype, upstream_entry_point)
    assert program.delegates() == 1 and not program.ops_outside()
    assert [(d.applied, d.detail) for d in decisions] == [
        (True, "3 pieces along dim 2"),
        (True, "2 pieces along dim 2"),
    ]
    (actual,) = program.run(*inputs)
    assert torch.equal(actual, expected[0])


def test_a_fused_qkv_projection_lowers_as_one_delegate():
    class Qkv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.project = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.project(x).split(16, dim=-1)
            return q * k + v

    torch.manual_seed(1)
    x = torch.randn(2, 5, 16)
    program, expected, decisions = _lower(Qkv().eval(), (x,))
    assert program.delegates() == 1 and not program.ops_outside()
    assert [d.applied for d in decisions] == [True]
    torch.testing.assert_close(program.run(x), expected, atol=1e-5, rtol=1e-5)


def test_an_integer_split_stays_with_its_reason():
    class IntegerPieces(torch.nn.Module):
        def forward(self, x):
            low, high = (x * x).split(4, -1)
            return low + high

    x = torch.arange(16).reshape(2, 8)
    program, expected, decisions = _lower(IntegerPieces(), (x,))
    assert [(d.applied, d.detail.split(":")[0]) for d in decisions] == [
        (False, "torch.int64 split")
    ]
    assert any(op in program.ops_outside() for op in SPLIT_OPS)
    assert torch.equal(program.run(x)[0], expected[0])


def test_a_split_of_a_dynamic_dim_stays_and_the_program_comes_back_as_it_was():
    batch = torch.export.Dim("batch", min=2, max=8)
    program = torch.export.export(
        Pieces(sizes=(2, 2), dim=-1), (torch.randn(2, 4),), dynamic_shapes=({0: batch},)
    )
    with collect_decisions() as decisions:
        assert splits_as_slices(program, bf16=False) is program
    assert [(d.applied, d.detail) for d in decisions if d.fold == FOLD][:1] == [
        (False, "dynamic shape: the slice bounds are not known when lowering")
    ]


@settings(max_examples=3)
@given(
    sizes=st.lists(st.integers(2, 6), min_size=2, max_size=4),  # the chunk halves the last
    dim=st.sampled_from([0, 1, -1]),
    dtype=st.sampled_from(DTYPES),
)
def test_generated_splits_join_the_delegate_bit_for_bit(sizes, dim, dtype):
    shape = [3, 4, 5]
    shape[dim] = sum(sizes)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(sizes))).to(dtype)
    program, expected, decisions = _lower(Pieces(sizes, dim).eval(), (x,))
    assert "aten.split_with_sizes_copy.default" not in program.ops_outside()
    assert decisions and all(d.applied for d in decisions)
    assert torch.equal(program.run(x)[0], expected[0])


def test_a_split_of_a_dequantized_input_stays_and_the_program_comes_back_as_it_was():
    from torch.ao.quantization.fx import _decomposed  # noqa: F401  (registers the q/dq ops)

    class DequantizedPieces(torch.nn.Module):
        def forward(self, codes):
            x = torch.ops.quantized_decomposed.dequantize_per_tensor(
                codes, 0.1, 0, -128, 127, torch.int8
            )
            low, high = x.split(4, -1)
            return low * high

    codes = torch.randint(-128, 128, (2, 8), dtype=torch.int8)
    program = torch.export.export(DequantizedPieces(), (codes,))
    with collect_decisions() as decisions:
        assert splits_as_slices(program, bf16=False) is program
    assert [(d.applied, d.detail.split(":")[0]) for d in decisions if d.fold == FOLD] == [
        (False, "quantized input")
    ]
