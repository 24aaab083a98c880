# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A constant that a GEMM reads as its static weight is read by nothing else in its delegate.

Each model runs on the XNNPACK runtime and is compared with eager; stock
ExecuTorch's error is measured beside etfold's, since stock shares the hazard
(a static conv weight that another op in the same delegate reads).

Re-partitioning ends: each round keeps out a node no round kept out before (so there
are at most as many rounds as nodes), or the partitioner raises, naming what repeated.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack.partition import xnnpack_partitioner
from etfold.backends.xnnpack.partition.constant_layout_conflicts import (
    LayoutConflict,
    find_layout_conflicts,
)
from etfold.backends.xnnpack.partition.xnnpack_partitioner import LAYOUT_FOLD
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower as etfold_lower
from etfold.harness.xnnpack_runner import lower_module_xnnpack, max_abs_error

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}


class WeightAlsoSourcesSecondWeight(torch.nn.Module):
    """One parameter is a conv weight and the source of a second conv's weight."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 4, 3, 3) * 0.3)
        self.b = torch.nn.Parameter(torch.randn(8) * 0.1)
        self.b2 = torch.nn.Parameter(torch.randn(8) * 0.1)

    def forward(self, x):
        bias = torch.tanh(self.b) * 2.0 + self.b2.sum()
        w2 = 0.5 * self.w + 0.1 * torch.tanh(self.w)
        return F.conv2d(x, self.w, bias, padding=2) + F.conv2d(x, w2, None, padding=2)


class SharedWeight(torch.nn.Module):
    """A weight read by two GEMMs and by an elementwise op whose result joins the output."""

    def __init__(self, kind: str, folded_bias: bool, out_channels: int = 8, in_channels: int = 4):
        super().__init__()
        self.kind, self.folded_bias = kind, folded_bias
        shape = (out_channels, in_channels, 3, 3) if kind == "conv" else (out_channels, 12)
        self.w = torch.nn.Parameter(torch.randn(shape) * 0.3)
        self.b = torch.nn.Parameter(torch.randn(out_channels) * 0.1)

    def _gemm(self, x, weight, bias):
        if self.kind == "conv":
            return F.conv2d(x, weight, bias, padding=1)
        return F.linear(x, weight, bias)

    def forward(self, x):
        bias = torch.tanh(self.b) * 2.0 if self.folded_bias else self.b
        first = self._gemm(x, self.w, bias)
        second = self._gemm(x, self.w, None)
        side = torch.tanh(self.w * 0.5)  # elementwise, reads the weight in its own layout
        if self.kind == "conv":
            return first + second * side.mean()
        return first + second + side.sum(dim=1)


def _inputs(kind: str, dtype: torch.dtype):
    shape = (1, 4, 7, 6) if kind == "conv" else (3, 12)
    return (torch.randn(shape).to(dtype),)


def _errors(module, inputs, with_stock=False, **partitioner_kwargs):
    """(stock error, or None where stock fails to run or is not asked for, etfold error,
    etfold program, decisions)."""
    with collect_decisions() as decisions:
        ours, reference = lower_module_xnnpack(
            module, inputs, [XnnpackPartitioner(**partitioner_kwargs)], lower=etfold_lower
        )
    error = max_abs_error(ours.run(*inputs), reference)
    if not with_stock:
        return None, error, ours, decisions
    try:
        stock, _ = lower_module_xnnpack(
            module, inputs, [UpstreamXnnpackPartitioner(**partitioner_kwargs)]
        )
        stock_error = max_abs_error(stock.run(*inputs), reference)
    except RuntimeError:  # stock's bf16 conv delegate fails to load in executorch 1.5.1
        stock_error = None
    return stock_error, error, ours, decisions


def test_weight_that_sources_a_second_weight_lowers_right():
    torch.manual_seed(0)
    module = WeightAlsoSourcesSecondWeight().eval()
    stock_error, error, program, _ = _errors(module, (torch.randn(1, 4, 7, 3),), with_stock=True)
    assert stock_error is not None and error <= max(10 * stock_error, 1e-5)
    assert program.delegates() >= 1


# `make test` runs the six cases in which each two of kind, bias and dtype meet;
# `make test-long` the other six
SHARED_WEIGHT_SHORT = {
    "conv-plain_bias-fp32",
    "linear-folded_bias-fp32",
    "conv-folded_bias-fp16",
    "linear-plain_bias-fp16",
    "conv-plain_bias-bf16",
    "linear-folded_bias-bf16",
}


@pytest.mark.parametrize(
    "kind, folded_bias, dtype",
    [
        pytest.param(kind, folded, dtype, id=case, marks=marks)
        for dtype, dtype_id in zip(TOLERANCE, ["fp32", "fp16", "bf16"], strict=True)
        for kind in ("conv", "linear")
        for folded, bias_id in ((False, "plain_bias"), (True, "folded_bias"))
        for case in [f"{kind}-{bias_id}-{dtype_id}"]
        for marks in [[] if case in SHARED_WEIGHT_SHORT else [pytest.mark.long]]
    ],
)
def test_weight_read_by_two_gemms_and_an_elementwise_op(kind, folded_bias, dtype):
    torch.manual_seed(1)
    module = SharedWeight(kind, folded_bias).to(dtype).eval()
    _, error, program, _ = _errors(module, _inputs(kind, dtype), enable_bf16=True)
    assert error <= TOLERANCE[dtype]
    assert program.delegates() >= 1


def test_static_weight_also_read_in_delegate_is_kept_out_with_reason():
    """Stock's own hazard: the bias is already static, and the weight also feeds a mul
    (with folding off, so the weight's other readers stay ops)."""
    torch.manual_seed(2)
    module = SharedWeight("conv", folded_bias=False).eval()
    _, error, program, decisions = _errors(
        module, _inputs("conv", torch.float32), fold_weights=False
    )
    assert error <= 1e-4
    reasons = [d.detail for d in decisions if d.fold == LAYOUT_FOLD and not d.applied]
    assert reasons and "NHWC conv weight" in reasons[0] and "stay outside" in reasons[0]


def test_two_convs_sharing_a_weight_stay_in_one_delegate():
    """Readers that need the same serialized form never conflict."""

    class TwoConvs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 4, 3, 3))

        def forward(self, x):
            return F.conv2d(x, self.w, padding=1) + F.conv2d(x * 2.0, self.w, padding=1)

    torch.manual_seed(3)
    x = torch.randn(1, 4, 6, 6)
    with collect_decisions() as decisions:
        program, reference = lower_module_xnnpack(
            TwoConvs().eval(), (x,), [XnnpackPartitioner()], lower=etfold_lower
        )
    assert program.delegates() == 1 and not program.ops_outside()
    assert not [d for d in decisions if d.fold == LAYOUT_FOLD]
    assert max_abs_error(program.run(x), reference) <= 1e-4


def _shared_weight_edge_program():
    torch.manual_seed(4)
    module = SharedWeight("conv", folded_bias=False).eval()
    program = torch.export.export(module, _inputs("conv", torch.float32))
    return etfold_lower(program, partitioner=[]).exported_program()


def _counting_rounds(monkeypatch) -> list:
    rounds, upstream = [], UpstreamXnnpackPartitioner.generate_partitions

    def counted(self, ep):
        rounds.append(ep)
        return upstream(self, ep)

    monkeypatch.setattr(UpstreamXnnpackPartitioner, "generate_partitions", counted)
    return rounds


def test_repartitioning_ends_within_one_round_per_node(monkeypatch):
    program, rounds = _shared_weight_edge_program(), _counting_rounds(monkeypatch)
    partitions = XnnpackPartitioner(fold_weights=False).generate_partitions(program)
    assert 2 <= len(rounds) <= len(program.graph.nodes) + 1  # a conflict, then settled
    assert find_layout_conflicts(program, (p.nodes for p in partitions)) == []


def test_a_round_keeping_out_nothing_new_raises_naming_the_partitioner(monkeypatch):
    program, rounds = _shared_weight_edge_program(), _counting_rounds(monkeypatch)
    conv = next(n for n in program.graph.nodes if "convolution" in str(n.target))
    mul = next(n for n in program.graph.nodes if "mul" in str(n.target))
    always = [LayoutConflict(conv.args[1], "NHWC conv weight", (mul,))]
    monkeypatch.setattr(xnnpack_partitioner, "find_layout_conflicts", lambda *_: always)
    with pytest.raises(RuntimeError, match="XnnpackPartitioner.generate_partitions") as raised:
        XnnpackPartitioner(fold_weights=False).generate_partitions(program)
    assert f"kept out {mul.name}, none of it new" in str(raised.value)
    assert len(rounds) == 2  # the first keeps the mul out; the second only repeats it
    assert not xnnpack_partitioner._KEPT_OUT.get()  # nothing left kept out after the raise


def test_finds_no_conflict_when_readers_are_in_different_partitions():
    torch.manual_seed(4)
    module = SharedWeight("conv", folded_bias=False).eval()
    program = torch.export.export(module, _inputs("conv", torch.float32))
    edge = etfold_lower(program, partitioner=[])
    graph = edge.exported_program().graph
    conv, *_ = [n for n in graph.nodes if "convolution" in str(n.target)]
    elementwise = [n for n in graph.nodes if "mul" in str(n.target)]
    one_partition = find_layout_conflicts(edge.exported_program(), [[conv, *elementwise]])
    assert one_partition and one_partition[0].constant.name.endswith("w")
    assert find_layout_conflicts(edge.exported_program(), [[conv], elementwise]) == []


@settings(
    max_examples=2,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    kind=st.sampled_from(["conv", "linear"]),
    out_channels=st.integers(1, 12),
    in_channels=st.integers(1, 6),
    folded_bias=st.booleans(),
)
def test_generated_shared_weights_never_mismatch(kind, out_channels, in_channels, folded_bias):
    torch.manual_seed(out_channels * 7 + in_channels)
    module = SharedWeight(kind, folded_bias, out_channels, in_channels).eval()
    shape = (1, in_channels, 6, 5) if kind == "conv" else (2, 12)
    _, error, _, _ = _errors(module, (torch.randn(shape),))
    assert error <= 1e-4
