# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Squeezes and unsqueezes between delegated ops run inside the delegate, as XNNPACK reshapes."""

from __future__ import annotations

import functools
import re
import types

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from executorch.exir.backend.partitioner import PartitionResult
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.shape_ops_as_views_pass import (
    FOLD,
    SHAPE_OP_MARK,
    match_shape_op,
    shape_ops_as_views,
)
from etfold.backends.xnnpack.partition.shape_op_partitions import settle_shape_op_views
from etfold.decisions import Declined, collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.dynamic_shapes import check_at_sizes, lower_dynamic
from etfold.harness.xnnpack_runner import (
    assert_close,
    eager_outputs,
    lower_module_xnnpack,
    lower_xnnpack,
)

SHAPE_OPS = ("aten.squeeze_copy.dims", "aten.squeeze_copy.dim", "aten.unsqueeze_copy.default")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _lower(module, inputs, partitioner=None, stock=False):
    if stock:
        return lower_module_xnnpack(module, inputs, [UpstreamXnnpackPartitioner()])
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(
            module,
            inputs,
            [partitioner or XnnpackPartitioner()],
            lower=to_edge_transform_and_lower,
        )
    program.decisions = [d for d in decisions if d.fold == FOLD]
    return program, expected


def _shape_ops_outside(program) -> int:
    outside = program.ops_outside()
    return sum(outside[op] for op in (*SHAPE_OPS, "aten.view_copy.default"))


def _declined(program) -> list[str]:
    return [d.detail for d in program.decisions if not d.applied]


class LinearUnsqueezeMulSqueeze(torch.nn.Module):
    """A decoder's shape bookkeeping: (B, D) -> (B, 1, D) -> scaled -> (B, D)."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.up = torch.nn.Linear(width, width)
        self.down = torch.nn.Linear(width, width)

    def forward(self, x):
        y = torch.relu(self.up(x).unsqueeze(1))
        return self.down(y.squeeze(1))


# fp16 in `make test-long`: the reshapes between convs and the conv1d/conv2d squeezes below
# join the delegate in fp16 in `make test`
@pytest.mark.parametrize(
    "dtype",
    [torch.float32, pytest.param(torch.float16, marks=pytest.mark.long), torch.bfloat16],
    ids=["fp32", "fp16", "bf16"],
)
def test_unsqueeze_and_squeeze_join_the_delegate(dtype):
    torch.manual_seed(0)
    module = LinearUnsqueezeMulSqueeze().to(dtype).eval()
    inputs = (torch.randn(4, 32).to(dtype),)
    if dtype == torch.float32:  # stock splits the delegate at the squeeze and unsqueeze
        stock, _ = _lower(module, inputs, stock=True)
        assert stock.delegates() == 3 and sum(stock.ops_outside().values()) == 2
    program, expected = _lower(module, inputs)
    assert program.delegates() == 1 and sum(program.ops_outside().values()) == 0
    assert [d.applied for d in program.decisions] == [True, True]
    assert_close(program.run(*inputs), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


class ConvThroughFiveDims(torch.nn.Module):
    """conv (NHWC inside XNNPACK) -> unsqueeze -> mul -> squeeze -> conv."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.first = torch.nn.Conv2d(4, 6, 3, padding=1)
        self.second = torch.nn.Conv2d(6, 4, 1)

    def forward(self, x):
        y = self.first(x).unsqueeze(self.dim)
        return self.second((y * 1.5 + 0.25).squeeze(self.dim))


class Conv1dThroughConv2d(torch.nn.Module):
    """(B, C, L) -conv1d-> unsqueeze(2) -conv2d (channels-last)-> squeeze(2) -> tanh,
    and a vocoder's final `squeeze(1)` of a one-channel conv."""

    def __init__(self):
        super().__init__()
        self.pre = torch.nn.Conv1d(4, 8, 3, padding=1)
        self.mid = torch.nn.Conv2d(8, 8, (1, 3), padding=(0, 1))
        self.post = torch.nn.Conv1d(8, 1, 3, padding=1)

    def forward(self, x):
        y = self.mid(self.pre(x).unsqueeze(2)).squeeze(2)
        return torch.tanh(self.post(y)).squeeze(1)


# each dim and each layout, fp16 channels-last, in `make test`; the other three pairings in
# `make test-long`
RESHAPE_LONG = {"contiguous-dim3-fp32", "contiguous-dim2-fp16", "channels_last-dim1-fp32"}


@pytest.mark.parametrize(
    "dim, dtype, channels_last",
    [
        pytest.param(dim, dtype, channels_last, id=case, marks=marks)
        for channels_last, layout in ((False, "contiguous"), (True, "channels_last"))
        for dim, dtype, name in (
            (1, torch.float32, "dim1-fp32"),
            (3, torch.float32, "dim3-fp32"),
            (2, torch.float16, "dim2-fp16"),
        )
        for case in [f"{layout}-{name}"]
        for marks in [[pytest.mark.long] if case in RESHAPE_LONG else []]
    ],
)
def test_reshape_between_convs_is_exact_in_both_layouts(dim, dtype, channels_last):
    torch.manual_seed(0)
    module = ConvThroughFiveDims(dim).to(dtype).eval()
    x = torch.randn(2, 4, 5, 7).to(dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    program, expected = _lower(module, (x,))
    assert program.delegates() == 1 and _shape_ops_outside(program) == 0
    assert_close(program.run(x), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_conv1d_conv2d_and_vocoder_squeeze_join_the_delegate(dtype):
    torch.manual_seed(0)
    module = Conv1dThroughConv2d().to(dtype).eval()
    inputs = (torch.randn(1, 4, 24).to(dtype),)
    program, expected = _lower(module, inputs)
    assert program.delegates() == 1 and sum(program.ops_outside().values()) == 0
    assert_close(program.run(*inputs), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


class ScaleReshapeShift(torch.nn.Module):
    def __init__(self, op: str, dim: int):
        super().__init__()
        self.op, self.dim = op, dim

    def forward(self, x):
        y = getattr(x * 2.0, self.op)(self.dim)
        return y + 1.0


@st.composite
def _shape_op_cases(draw):
    rank = draw(st.integers(1, 5))
    shape = draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank))
    if rank == 1 or draw(st.booleans()):  # squeezing to 0-d is declined (rank)
        return shape, "unsqueeze", draw(st.integers(-rank - 1, rank))
    dim = draw(st.integers(-rank, rank - 1))
    shape[dim] = draw(st.sampled_from([1, 1, 3]))  # squeezing a size > 1 dim is the identity
    return shape, "squeeze", dim


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_shape_op_cases(), channels_last=st.booleans())
def test_any_rank_and_dim_runs_inside_the_delegate(case, channels_last):
    shape, op, dim = case
    x = torch.randn(shape)
    if channels_last and x.dim() == 4:
        x = x.to(memory_format=torch.channels_last)
    program, expected = _lower(ScaleReshapeShift(op, dim), (x,))
    assert program.delegates() == 1 and sum(program.ops_outside().values()) == 0
    assert_close(program.run(x), expected, atol=1e-6)


def test_one_symbolic_size_becomes_the_inferred_dim():
    torch.manual_seed(0)
    module = LinearUnsqueezeMulSqueeze().eval()
    batch = torch.export.Dim("batch", min=2, max=16)
    program = torch.export.export(module, (torch.randn(4, 32),), dynamic_shapes=({0: batch},))
    with collect_decisions() as decisions:
        lowered = lower_xnnpack(program, [XnnpackPartitioner()], lower=to_edge_transform_and_lower)
    assert lowered.delegates() == 1 and sum(lowered.ops_outside().values()) == 0
    assert [d.applied for d in decisions if d.fold == FOLD] == [True, True]
    for rows in (3, 9):
        x = torch.randn(rows, 32)
        assert_close(lowered.run(x), eager_outputs(module, (x,)), atol=1e-5)


class HeadsOnADynamicSequence(torch.nn.Module):
    """A dynamic export's reshapes: `view(b, t, heads, d)` with t a symbolic size, and back."""

    def __init__(self, width: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        b, t, width = x.shape
        y = self.proj(x).view(b, t, self.heads, width // self.heads)
        return (torch.relu(y) * 2.0).view(b, t, width)


@functools.cache
def _lowered_heads(dynamic: bool):
    torch.manual_seed(0)
    module = HeadsOnADynamicSequence().eval()
    tokens = torch.export.Dim("tokens", min=2, max=32)
    dims = ({1: tokens},) if dynamic else None
    program, decisions = lower_dynamic(
        module,
        (torch.randn(1, 8, 32),),
        dims,
        [XnnpackPartitioner()],
        lower=to_edge_transform_and_lower,
    )
    return module, program, [d for d in decisions if d.fold == FOLD]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_views_with_a_symbolic_size_join_the_delegate(dynamic):
    """Static: upstream's own views, nothing to rewrite. Dynamic: the symbolic size becomes
    the one inferred size, and the program is one delegate as the static one is."""
    module, program, decisions = _lowered_heads(dynamic)
    assert program.delegates() == 1 and not program.ops_outside()
    expected = ["view.default([1, s, 4, 8],)", "view.default([1, s, 32],)"] if dynamic else []
    details = [
        re.sub(r"s\d+", "s", d.detail).removesuffix(" runs as an XNNPACK reshape")
        for d in decisions
    ]
    assert details == expected and all(d.applied for d in decisions)
    sizes = (2, 13, 32) if dynamic else (8,)
    check_at_sizes(program, module, lambda t: (torch.randn(1, t, 32),), sizes, atol=1e-5)


def test_a_symbolic_view_is_written_with_its_output_shape():
    tokens = torch.export.Dim("tokens", min=2, max=32)
    program = torch.export.export(
        HeadsOnADynamicSequence(), (torch.randn(1, 8, 32),), dynamic_shapes=({1: tokens},)
    )
    rewritten = shape_ops_as_views(program, frozenset({"linear.default"}), bf16=False)
    views = [n for n in rewritten.graph.nodes if n.target is torch.ops.aten.view.default]
    assert [v.args[1] for v in views] == [[1, -1, 4, 8], [1, -1, 32]]
    assert not [n for n in rewritten.graph.nodes if n.target is torch.ops.aten.sym_size.int]
    x = torch.randn(1, 5, 32)
    assert torch.equal(rewritten.module()(x), program.module()(x))


# ---- declines: the op stays outside, as upstream has it, and the reason is recorded


class IntUnsqueeze(torch.nn.Module):
    def forward(self, ids, x):
        return (ids + 1).unsqueeze(0), x * 2.0


def test_declines_when_the_tensor_is_not_float():
    inputs = (torch.arange(6).reshape(2, 3), torch.randn(3))
    program, expected = _lower(IntUnsqueeze(), inputs)
    assert program.ops_outside()["aten.unsqueeze_copy.default"] == 1
    assert any(r.startswith("torch.int64 tensor") for r in _declined(program))
    assert_close(program.run(*inputs), expected, atol=0)


class Bf16BmmUnsqueeze(torch.nn.Module):
    def forward(self, a, b):
        return torch.bmm(a, b).unsqueeze(1)


def test_declines_when_bf16_is_refused_by_the_user():
    inputs = (torch.randn(2, 3, 4).bfloat16(), torch.randn(2, 4, 5).bfloat16())
    program, expected = _lower(Bf16BmmUnsqueeze(), inputs, XnnpackPartitioner(enable_bf16=False))
    assert program.ops_outside()["aten.unsqueeze_copy.default"] == 1
    assert any(r.startswith("torch.bfloat16 tensor") for r in _declined(program))
    assert_close(program.run(*inputs), expected, atol=0)


class ScaleThenReshape(torch.nn.Module):
    def __init__(self, op: str, dim: int):
        super().__init__()
        self.op, self.dim = op, dim

    def forward(self, x):
        return getattr(x * 2.0, self.op)(self.dim)


@pytest.mark.parametrize(
    "shape, op, ranks",
    [((1, 2, 1, 2, 1, 2), "unsqueeze", "6 -> 7"), ((1,), "squeeze", "1 -> 0")],
    ids=["rank6_to_7", "rank1_to_0"],
)
def test_declines_when_the_rank_is_outside_xnnpack(shape, op, ranks):
    x = torch.randn(shape)
    module = ScaleThenReshape(op, 0)
    program, expected = _lower(module, (x,))
    assert (
        program.ops_outside()[f"aten.{op}_copy.{'default' if op == 'unsqueeze' else 'dims'}"] == 1
    )
    assert program.delegates() == 1  # the scale alone, as upstream has it
    assert _declined(program) == [
        f"rank {ranks}: XNNPACK tensors have 1 to 6 dims",
    ]
    assert_close(program.run(x), expected, atol=1e-6)


class EmbeddingUnsqueeze(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(10, 4)

    def forward(self, ids):
        return self.table(ids).unsqueeze(1)


def test_declines_when_nothing_beside_it_goes_to_xnnpack():
    module, inputs = EmbeddingUnsqueeze().eval(), (torch.tensor([1, 2, 3]),)
    program, expected = _lower(module, inputs)
    assert program.delegates() == 0
    assert program.ops_outside()["aten.unsqueeze_copy.default"] == 1
    assert _declined(program) == [
        "no op beside it goes to XNNPACK: a delegate holding only a reshape"
    ]
    assert_close(program.run(*inputs), expected, atol=0)


def test_declines_when_more_than_one_size_is_symbolic():
    module = ScaleThenReshape("unsqueeze", 1)
    dims = {0: torch.export.Dim("rows", min=2, max=8), 1: torch.export.Dim("cols", min=2, max=8)}
    program = torch.export.export(module, (torch.randn(3, 5),), dynamic_shapes=(dims,))
    with collect_decisions() as decisions:
        lowered = lower_xnnpack(program, [XnnpackPartitioner()], lower=to_edge_transform_and_lower)
    assert lowered.ops_outside()["aten.unsqueeze_copy.default"] == 1
    (reason,) = [d.detail for d in decisions if d.fold == FOLD]
    assert re.fullmatch(
        r"sizes \[0, 2\] are symbolic \(dim 0 \(s\d+ in 2\.\.8\), dim 2 \(s\d+ in 2\.\.8\)\): "
        r"XNNPACK's static reshape infers at most one",
        reason,
    )
    x = torch.randn(4, 6)
    assert_close(lowered.run(x), eager_outputs(module, (x,)), atol=1e-6)


def test_declines_when_a_user_writes_into_it_in_place():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(2, 3)
    unsqueezed = graph.call_function(torch.ops.aten.unsqueeze.default, (x, 0))
    unsqueezed.meta["val"] = torch.empty(1, 2, 3)
    graph.call_function(torch.ops.aten.add_.Tensor, (unsqueezed, 1.0))
    found = match_shape_op(unsqueezed, frozenset({"add.Tensor"}), {torch.float32})
    assert found == Declined("a user writes into it in place")


def test_declines_when_the_op_has_no_tensor_metadata():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    unsqueezed = graph.call_function(torch.ops.aten.unsqueeze.default, (x, 0))
    found = match_shape_op(unsqueezed, frozenset(), {torch.float32})
    assert found == Declined("no tensor metadata on the op or its input")


class Bf16MaxPoolUnsqueeze(torch.nn.Module):
    def forward(self, a):
        return torch.nn.functional.max_pool2d(a, 2).unsqueeze(1)


def test_a_reshape_left_alone_in_a_delegate_is_dropped():
    """bf16 max pooling does not compile on XNNPACK: the unsqueeze beside it would be a
    delegate alone."""
    inputs = (torch.randn(1, 2, 4, 4).bfloat16(),)
    module = Bf16MaxPoolUnsqueeze()
    program, expected = _lower(module, inputs, XnnpackPartitioner(enable_bf16=True))
    assert program.delegates() == 0
    assert sum(n.startswith("aten.max_pool2d") for n in program.ops_outside()) == 1
    assert _declined(program) == [
        "unsqueeze.default(1,): no delegated op beside it; a reshape-only delegate"
    ]
    assert_close(program.run(*inputs), expected, atol=0)


def test_records_when_xnnpack_view_config_declines():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    view = graph.call_function(torch.ops.aten.view.default, (x, [1, 3]))
    view.meta["custom"] = {SHAPE_OP_MARK: "unsqueeze.default(0,)"}
    graph.output(view)
    program = types.SimpleNamespace(graph=graph)
    with collect_decisions() as decisions:
        result = settle_shape_op_views(PartitionResult(program, {}))
    assert result.partition_tags == {}
    assert [(d.applied, d.detail) for d in decisions] == [
        (False, "unsqueeze.default(0,): XNNPACK's view_copy config declined it")
    ]


def test_per_op_mode_leaves_squeezes_and_unsqueezes_as_upstream_has_them():
    torch.manual_seed(0)
    module, inputs = LinearUnsqueezeMulSqueeze().eval(), (torch.randn(4, 32),)
    program, expected = _lower(module, inputs, XnnpackPartitioner(per_op_mode=True))
    outside = program.ops_outside()
    assert outside["aten.unsqueeze_copy.default"] == 1 and outside["aten.squeeze_copy.dims"] == 1
    assert program.decisions == []
    assert_close(program.run(*inputs), expected, atol=1e-5)
