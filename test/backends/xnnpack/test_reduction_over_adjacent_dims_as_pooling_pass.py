# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A mean or sum over adjacent dims (a ViT's token mean over dim 1 among them) runs inside
the delegate as XNNPACK's pooling, static and dynamic, matching eager and stock."""

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
from etfold.backends.xnnpack._passes.reduction_over_adjacent_dims_as_pooling_pass import (
    FOLD,
    reductions_over_adjacent_dims_as_pooling,
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

MEAN = "aten.mean.dim"


class TokenMean(torch.nn.Module):
    """A ViT head: a linear over tokens, the CLS token and the mean of the others."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        x = self.linear(x)
        return torch.relu(x[:, 0]), torch.relu(x[:, 1:].mean(dim=1))


class Reductions(torch.nn.Module):
    """Means and sums over one or several adjacent dims, first, inner and last."""

    def forward(self, x):  # x: [B, T, H, C]
        x = torch.relu(x)
        return (
            x.mean(dim=1),
            x.mean(dim=(1, 2), keepdim=True),
            x.mean(dim=-2),
            x.mean(dim=(-2, -1)),
            x.sum(dim=1),
            x.sum(dim=-1, keepdim=True),
            x.mean(dim=0),
        )


class Reduce(torch.nn.Module):
    def __init__(self, kind: str, dims, keepdim: bool = False, **kwargs):
        super().__init__()
        self.kind, self.dims, self.keepdim, self.kwargs = kind, dims, keepdim, kwargs

    def forward(self, x):
        reduce = torch.mean if self.kind == "mean" else torch.sum
        return reduce(torch.relu(x), self.dims, keepdim=self.keepdim, **self.kwargs) * 2


@functools.cache
def _reductions(partitioner: str):
    torch.manual_seed(0)
    inputs = (torch.randn(2, 5, 3, 8),)
    if partitioner == "stock":
        return lower_module_xnnpack(Reductions(), inputs, [UpstreamXnnpackPartitioner()]), ()
    with collect_decisions() as decisions:
        lowered = lower_module_xnnpack(
            Reductions(), inputs, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
        )
    return lowered, tuple(d for d in decisions if d.fold == FOLD)


def test_every_adjacent_block_reduces_inside_one_delegate_as_eager_and_stock_do():
    (program, expected), decisions = _reductions("etfold")
    (stock, _), _ = _reductions("stock")
    assert stock.ops_outside()[MEAN] == 5 and stock.ops_outside()["aten.sum.dim_IntList"] == 2
    assert program.delegates() == 1 and not program.ops_outside()
    assert len(decisions) == 7 and all(d.applied for d in decisions)
    inputs = (torch.randn(2, 5, 3, 8, generator=torch.Generator().manual_seed(0)),)
    actual = program.run(*inputs)
    assert_close(actual, Reductions()(*inputs), atol=1e-5, rtol=1e-5)
    assert_close(actual, stock.run(*inputs), atol=1e-5, rtol=1e-5)


def test_the_rewrite_is_a_view_a_permute_and_a_mean_over_the_pooled_plane():
    program = torch.export.export(Reduce("mean", 1), (torch.randn(2, 5, 8),))
    rewritten = reductions_over_adjacent_dims_as_pooling(program, bf16=False)
    ops = [n.target for n in rewritten.graph.nodes if n.op == "call_function"]
    aten = torch.ops.aten
    assert ops[1:5] == [aten.view.default, aten.permute.default, aten.mean.dim, aten.view.default]
    (mean,) = [n for n in rewritten.graph.nodes if n.target == aten.mean.dim]
    assert mean.args[1:] == ([2, 3], True) and list(mean.args[0].meta["val"].shape) == [2, 8, 5, 1]
    x = torch.randn(2, 5, 8)
    assert_close([rewritten.module()(x)], [Reduce("mean", 1)(x)], atol=1e-6)


def _batch(length: int) -> tuple[torch.Tensor]:
    return (torch.randn(length, 9, 16, generator=torch.Generator().manual_seed(length)),)


def _tokens(length: int) -> tuple[torch.Tensor]:
    return (torch.randn(2, length, 16, generator=torch.Generator().manual_seed(length)),)


def _assert_pair_pools_alike(pair, copied: bool) -> None:
    assert decisions_apart(pair, lambda fold: fold == FOLD) == ({}, {})
    (applied,) = [d for d in pair.dynamic.decisions if d.fold == FOLD]
    assert applied.applied and ("copied contiguous first" in applied.detail) == copied
    static, dynamic = pair.static.program, pair.dynamic.program
    assert static.delegates() == dynamic.delegates() == 1
    assert not static.ops_outside() and not dynamic.ops_outside()
    errors = dynamic_errors(pair)
    low, high = pair.length.low, pair.length.high
    assert set(errors) >= {low, high} and len(errors) == 4 and max(errors.values()) <= 1e-5


def test_a_vit_token_mean_joins_the_delegate_static_and_dynamic_at_every_bound():
    """`x[:, 1:]` is a slice: copied contiguous first, then pooled over the tokens; the
    batch is dynamic (a slice of a dynamic dim is the dynamic-slice pass's to judge)."""
    pair = lower_xnnpack_pair(TokenMean, _batch, LengthAxis(((0,),), 1, 8, 3))
    _assert_pair_pools_alike(pair, copied=True)


class MeanOverTokens(torch.nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.linear(x).mean(dim=1))


@pytest.mark.long
def test_a_mean_over_a_dynamic_number_of_tokens_pools_like_the_static_one_at_every_bound():
    pair = lower_xnnpack_pair(MeanOverTokens, _tokens, LengthAxis(((1,),), 1, 40, 9))
    _assert_pair_pools_alike(pair, copied=False)


def _declined_by_pass(module, inputs, **export_kwargs) -> list[str]:
    """The pass on the exported program: it must come back unchanged; the reasons."""
    program = torch.export.export(module.eval(), inputs, **export_kwargs)
    before = program.graph_module.code
    with collect_decisions() as decisions:
        result = reductions_over_adjacent_dims_as_pooling(program, bf16=False)
    assert result is program and program.graph_module.code == before
    return [d.detail for d in decisions if d.fold == FOLD and not d.applied]


def test_declines_when_the_dims_are_not_adjacent():
    (reason,) = _declined_by_pass(Reduce("mean", (0, 2)), (torch.randn(2, 3, 4),))
    assert "reduces dims [0, 2]: not adjacent" in reason


def test_declines_when_it_has_a_dtype_override():
    (reason,) = _declined_by_pass(Reduce("sum", 1, dtype=torch.float32), (torch.randn(2, 3, 4),))
    assert "explicit dtype" in reason


def test_declines_when_the_result_is_0d():
    (reason,) = _declined_by_pass(Reduce("mean", (0, 1)), (torch.randn(3, 4),))
    assert "a 0-d result" in reason


def test_declines_when_xnnpack_cannot_compile_its_dtype():
    (reason,) = _declined_by_pass(Reduce("mean", 0), (torch.randn(3, 4).to(torch.bfloat16),))
    assert reason.startswith("torch.bfloat16 mean")


def test_declines_when_a_sum_is_over_a_dynamic_dim():
    length = torch.export.Dim("length", min=2, max=16)
    inputs = (torch.randn(2, 5, 4),)
    (reason,) = _declined_by_pass(Reduce("sum", 1), inputs, dynamic_shapes=({1: length},))
    assert reason.startswith("dynamic shape: dim 1 (") and "runtime size" in reason


def test_declines_when_a_view_would_infer_two_sizes():
    batch, length = (
        torch.export.Dim("batch", min=2, max=8),
        torch.export.Dim("length", min=2, max=8),
    )
    inputs = (torch.randn(2, 5, 3, 4),)
    dims = ({0: batch, 2: length},)
    (reason,) = _declined_by_pass(Reduce("mean", 1), inputs, dynamic_shapes=dims)
    assert "would infer 2 sizes" in reason


def test_declines_when_the_input_may_be_empty():
    (reason,) = _declined_by_pass(Reduce("mean", 0), (torch.randn(0, 4),))
    assert "empty input" in reason


def test_declines_when_the_input_is_quantized():
    class Dequantized(torch.nn.Module):
        def forward(self, q):
            x = torch.ops.quantized_decomposed.dequantize_per_tensor(
                q, 0.1, 0, -128, 127, torch.int8
            )
            return x.mean(dim=0)

    inputs = (torch.randint(-128, 127, (3, 4), dtype=torch.int8),)
    (reason,) = _declined_by_pass(Dequantized(), inputs)
    assert reason.startswith("quantized input")


@pytest.mark.long
@settings(max_examples=6)
@given(
    shape=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    data=st.data(),
    kind=st.sampled_from(["mean", "sum"]),
    keepdim=st.booleans(),
)
def test_generated_reductions_match_eager_and_stock(shape, data, kind, keepdim):
    first = data.draw(st.integers(0, len(shape) - 1))
    last = data.draw(st.integers(first + 1, len(shape)))
    dims = tuple(range(first, last))
    module = Reduce(kind, dims, keepdim).eval()
    inputs = (torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape))),)
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(
            module, inputs, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
        )
    stock, _ = lower_module_xnnpack(module, inputs, [UpstreamXnnpackPartitioner()])
    assert_close(program.run(*inputs), expected, atol=1e-5, rtol=1e-5)
    assert_close(program.run(*inputs), stock.run(*inputs), atol=1e-5, rtol=1e-5)
    whole = len(dims) == len(shape) and not keepdim  # a 0-d result: declined
    outside = program.ops_outside()
    assert (MEAN in outside or "aten.sum.dim_IntList" in outside) == whole
    mine = [d.applied for d in decisions if d.fold == FOLD]
    assert mine == [False] if whole else all(mine)
