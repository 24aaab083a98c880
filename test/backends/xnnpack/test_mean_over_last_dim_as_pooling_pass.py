# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A mean over the last dim (RMSNorm's) runs inside the delegate, as XNNPACK's 4-D pooling."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.mean_over_last_dim_as_pooling_pass import (
    FOLD,
    means_over_last_dim_as_pooling,
)
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.dynamic_pairs import (
    LengthAxis,
    decisions_apart,
    dynamic_errors,
    lower_static_and_dynamic,
)
from etfold.harness.xnnpack_runner import assert_close, lower_module_xnnpack

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}


class RMSNorm(torch.nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Mean(torch.nn.Module):
    def __init__(self, dim=-1, keepdim=True, **kwargs):
        super().__init__()
        self.dim, self.keepdim, self.kwargs = dim, keepdim, kwargs

    def forward(self, x):
        return torch.relu(x).mean(self.dim, keepdim=self.keepdim, **self.kwargs) * 2


class TransposedMean(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x).transpose(0, 1).mean(-1, keepdim=True)


@functools.cache
def _lowered(dtype: torch.dtype, upstream_entry_point: bool):
    torch.manual_seed(0)
    module, inputs = RMSNorm().to(dtype).eval(), (torch.randn(2, 5, 16).to(dtype),)
    lower = {} if upstream_entry_point else {"lower": to_edge_transform_and_lower}
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(module, inputs, [XnnpackPartitioner()], **lower)
    return program, expected, inputs, [d for d in decisions if d.fold == FOLD]


@pytest.mark.parametrize(
    ("dtype", "upstream_entry_point"),
    [(torch.float32, True), (torch.float32, False), (torch.float16, False)],
)
def test_rmsnorm_mean_joins_the_delegate(dtype, upstream_entry_point):
    program, expected, inputs, decisions = _lowered(dtype, upstream_entry_point)
    assert program.delegates() == 1
    assert "aten.mean.dim" not in program.ops_outside()
    assert [(d.applied, d.detail) for d in decisions] == [
        (True, "mean over the last 16 values of 10 rows")  # [2, 5, 16]
    ]
    assert_close(program.run(*inputs), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_bf16_rmsnorm_mean_widened_to_fp32_runs_as_pooling_and_matches_eager():
    """XNNPACK compiles no bf16 mean: the widening pass computes it in fp32 first."""
    program, expected, inputs, decisions = _lowered(torch.bfloat16, False)
    assert "aten.mean.dim" not in program.ops_outside() and program.delegates() == 1
    assert [d.applied for d in decisions] == [True]
    assert_close(program.run(*inputs), expected, atol=5e-2, rtol=5e-2)


def _declined_by_pass(module, inputs, *, bf16=False, **export_kwargs) -> list[str]:
    """The pass on the exported program: it must come back unchanged; the reasons."""
    program = torch.export.export(module.eval(), inputs, **export_kwargs)
    before = program.graph_module.code
    with collect_decisions() as decisions:
        result = means_over_last_dim_as_pooling(program, bf16=bf16)
    assert result is program and program.graph_module.code == before
    return [d.detail for d in decisions if d.fold == FOLD and not d.applied]


def test_declines_when_the_views_would_have_no_dims():
    (reason,) = _declined_by_pass(Mean(keepdim=False), (torch.randn(8),))
    assert "rank 1 input (keepdim=False)" in reason


def test_declines_when_it_reduces_another_dim():
    (reason,) = _declined_by_pass(Mean(dim=1), (torch.randn(2, 3, 4),))
    assert "reduces dims [1]" in reason


def test_declines_when_it_has_a_dtype_override():
    (reason,) = _declined_by_pass(Mean(dtype=torch.float32), (torch.randn(2, 4),))
    assert "explicit dtype" in reason


def test_declines_when_xnnpack_cannot_compile_its_dtype():
    (reason,) = _declined_by_pass(Mean(), (torch.randn(2, 4).to(torch.bfloat16),))
    assert "torch.bfloat16 mean" in reason


def _rows(length: int, width: int = 16) -> tuple[torch.Tensor]:
    return (torch.randn(1, length, width, generator=torch.Generator().manual_seed(length)),)


@pytest.mark.parametrize(
    ("module", "axis"),
    [
        (RMSNorm(), LengthAxis(((1,),), 2, 48, 8)),
        (Mean(keepdim=False), LengthAxis(((1,),), 3, 9, 5)),
    ],
    ids=["rmsnorm-keepdim", "mean-no-keepdim"],
)
def test_a_dynamic_length_pools_like_the_static_one_at_every_bound(module, axis):
    """The [1, -1, 1, C] view leaves the rows to the runtime: one delegate, static or not."""
    pair = lower_static_and_dynamic(module, _rows, axis, lambda: [XnnpackPartitioner()])
    assert decisions_apart(pair, lambda fold: fold == FOLD) == ({}, {})
    assert [d.applied for d in pair.dynamic.decisions if d.fold == FOLD] == [True]
    static, dynamic = pair.static.program, pair.dynamic.program
    assert static.delegates() == dynamic.delegates() == 1
    assert static.ops_outside() == dynamic.ops_outside()
    assert "aten.mean.dim" not in dynamic.ops_outside()
    errors = dynamic_errors(pair)
    assert set(errors) >= {axis.low, axis.high} and len(errors) == 4
    assert max(errors.values()) <= 1e-5


def test_declines_when_two_dims_of_the_view_back_are_dynamic():
    rows, cols = torch.export.Dim("rows", min=2, max=8), torch.export.Dim("cols", min=2, max=8)
    inputs = (torch.randn(3, 4, 6),)
    (reason,) = _declined_by_pass(Mean(), inputs, dynamic_shapes=({0: rows, 1: cols},))
    assert reason.startswith("dynamic shape: dim 0 (") and ", dim 1 (" in reason
    assert reason.endswith("the view back would infer 2 sizes; XNNPACK's reshape infers one")


def test_declines_when_the_width_and_a_row_dim_are_both_dynamic():
    rows, width = torch.export.Dim("rows", min=2, max=8), torch.export.Dim("width", min=2, max=8)
    inputs = (torch.randn(3, 6),)
    (reason,) = _declined_by_pass(Mean(), inputs, dynamic_shapes=({0: rows, 1: width},))
    assert "would infer 2 sizes" in reason and "dim 1 (" in reason


def test_declines_when_the_input_is_empty():
    (reason,) = _declined_by_pass(Mean(), (torch.randn(0, 4),))
    assert "empty input" in reason


def test_declines_when_the_input_is_not_contiguous():
    (reason,) = _declined_by_pass(TransposedMean(), (torch.randn(3, 4, 5),))
    assert "not contiguous" in reason


@settings(max_examples=2)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(lambda s: [*s, 6]),
    last=st.booleans(),
    keepdim=st.booleans(),
)
def test_generated_means_match_eager_and_leave_the_last_dim_ones_delegated(shape, last, keepdim):
    """A mean over another dim is `reduction_over_adjacent_dims_as_pooling_pass`'s."""
    module = Mean(dim=-1 if last else 0, keepdim=keepdim).eval()
    inputs = (torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape))),)
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(module, inputs, [XnnpackPartitioner()])
    assert_close(program.run(*inputs), expected, atol=1e-5, rtol=1e-5)
    applied = [d.applied for d in decisions if d.fold == FOLD]
    over_last = last or len(shape) == 1
    rewritten = over_last and (keepdim or len(shape) > 1)
    assert applied == ([rewritten] if over_last else [])
    assert ("aten.mean.dim" in program.ops_outside()) == (over_last and not rewritten)
