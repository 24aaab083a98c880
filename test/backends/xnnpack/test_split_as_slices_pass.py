# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A split (a fused QKV projection's, a chunked half's) runs inside the delegate as slices."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.split_as_slices_pass import FOLD, splits_as_slices
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.dynamic_shapes import lower_dynamic
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


# Through upstream's entry point in `make test-long`: both entry points run the one
# pre-decomposition hook and decide alike (test_entry_point_pairs, in `make test`)
@pytest.mark.parametrize(
    ("dtype", "upstream_entry_point"),
    [
        (torch.float32, False),
        (torch.float16, False),
        (torch.bfloat16, False),
        pytest.param(torch.float32, True, marks=pytest.mark.long),
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


@functools.cache
def _lowered_dynamic():
    """Pieces on [2, T, 16], T dynamic: the slices along the static last dim keep T whole."""
    tokens = torch.export.Dim("tokens", min=2, max=24)
    module = Pieces().eval()
    example = (torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0)),)
    program, decisions = lower_dynamic(
        module, example, ({1: tokens},), [XnnpackPartitioner()], lower=to_edge_transform_and_lower
    )
    return module, program, [d for d in decisions if d.fold == FOLD]


def test_a_dynamic_export_decides_as_the_static_one():
    """The same decisions as the static export of the same module; one delegate, nothing out."""
    _, program, decisions = _lowered_dynamic()
    _, _, static_decisions, _ = _lowered(torch.float32, False)
    assert [(d.applied, d.detail) for d in decisions] == [
        (d.applied, d.detail) for d in static_decisions
    ]
    assert program.delegates() == 1 and not program.ops_outside()


@pytest.mark.parametrize("tokens", [2, 11, 24], ids=["min", "between", "max"])
def test_dynamic_slices_resize_on_the_runtime_bit_for_bit(tokens):
    module, program, _ = _lowered_dynamic()
    x = torch.randn(2, tokens, 16)
    (actual,) = program.run(x)
    assert torch.equal(actual, module(x))


def test_a_split_along_the_dynamic_dim_stays_and_the_program_comes_back_as_it_was():
    class Halves(torch.nn.Module):
        def forward(self, x):
            first, second = (x * x).chunk(2, 0)
            return first + second

    rows = torch.export.Dim("rows", min=3, max=8)
    program = torch.export.export(Halves(), (torch.randn(6, 4),), dynamic_shapes=({0: 2 * rows},))
    with collect_decisions() as decisions:
        assert splits_as_slices(program, bf16=False) is program
    (reason,) = [d.detail for d in decisions if d.fold == FOLD]
    assert re.fullmatch(
        r"dynamic shape: splits dim 0 \(2\*s\d+ in 6\.\.16\); the slice bounds change "
        r"with the input",
        reason,
    )


@settings(max_examples=2)
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
