# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The min or max of two sizes becomes the operand it is at every allowed size, so a
dynamic program that cuts two lengths to the shorter lowers (stock's Edge verifier
refuses `torch.sym_min`) and runs at every length."""

from __future__ import annotations

import functools

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as StockPartitioner,
)
from executorch.exir import to_edge_transform_and_lower as upstream_lower
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.symbolic_shapes import statically_known_true

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.exir.passes.graph_walk import order_at_every_size
from etfold.exir.passes.size_min_max_decided_over_the_bounds_pass import (
    FOLD,
    SizeMinMaxUndecided,
    size_min_max_decided_over_the_bounds,
)
from etfold.harness.xnnpack_runner import assert_close, eager_outputs, lower_xnnpack

LOW, HIGH = 400, 3200


class PooledAndConvolvedCut(torch.nn.Module):
    """SEW's cut, small: frames from samples by three strided convs, then the frames
    pooled by 2 beside a stride-2 positional conv less its last output; torch writes the
    two lengths as `(L//20 - 1)//2` and `(L//20 - 3)//2 + 1`, equal at every L but not
    to its reasoning. Cut to the shorter (`min`), or read up to the longer on their
    concat (`max`)."""

    def __init__(self, longer: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.features = torch.nn.Sequential(
            torch.nn.Conv1d(1, 4, 10, stride=5),
            torch.nn.Conv1d(4, 4, 3, stride=2),
            torch.nn.Conv1d(4, 4, 3, stride=2),
        )
        self.position = torch.nn.Conv1d(4, 4, 16, padding=8, stride=2)
        self.longer = longer

    def forward(self, x):
        frames = self.features(x)
        pooled = torch.nn.functional.avg_pool1d(frames, 2, 2)
        position = self.position(frames)[..., :-1]
        if self.longer:
            n = max(position.size(-1), pooled.size(-1))
            return torch.cat([pooled, position], dim=-1)[..., :n]
        n = min(position.size(-1), pooled.size(-1))
        return pooled[..., :n] + position[..., :n]


class CutToShorter(torch.nn.Module):
    def forward(self, x, y):
        n = min(x.size(-1), y.size(-1))
        return x[..., :n] + y[..., :n]


def _signal(length: int) -> tuple[torch.Tensor]:
    return (torch.randn(1, 1, length, generator=torch.Generator().manual_seed(length)),)


@functools.cache
def _exported(longer: bool = False) -> torch.export.ExportedProgram:
    length = torch.export.Dim.DYNAMIC(min=LOW, max=HIGH)  # as users declare audio
    module = PooledAndConvolvedCut(longer).eval()
    return torch.export.export(module, _signal(1600), dynamic_shapes=({2: length},))


def _lengths(program: torch.export.ExportedProgram):
    node = next(n for n in program.graph.nodes if n.target in (torch.sym_min, torch.sym_max))
    return tuple(arg.meta["val"] for arg in node.args)


def test_torch_cannot_prove_the_order_so_every_length_is_tried():
    pooled, convolved = _lengths(_exported())
    assert not statically_known_true(pooled >= convolved)
    assert not statically_known_true(pooled <= convolved)
    assert order_at_every_size(pooled, convolved) in ("<=", ">=")
    assert order_at_every_size(pooled, convolved, limit=HIGH - LOW) is None  # too many


def test_stock_refuses_the_program_in_its_edge_verifier():
    with pytest.raises(AssertionError):
        upstream_lower(_exported(), partitioner=[StockPartitioner()])


@pytest.mark.parametrize("longer", [False, True], ids=["min", "max"])
def test_the_op_becomes_its_operand_on_a_copy_and_computes_the_same(longer):
    program = _exported(longer)
    code = program.graph_module.code
    with collect_decisions() as decisions:
        rewritten = size_min_max_decided_over_the_bounds(program)
    assert program.graph_module.code == code and rewritten is not program
    targets = {n.target for n in rewritten.graph.nodes}
    assert torch.sym_min not in targets and torch.sym_max not in targets
    (decision,) = [d for d in decisions if d.fold == FOLD]
    assert decision.applied and "at every allowed size" in decision.detail
    module = PooledAndConvolvedCut(longer).eval()
    for length in (LOW, 1801, 2019, HIGH):
        inputs = _signal(length)
        torch.testing.assert_close(rewritten.module()(*inputs), module(*inputs))


def test_an_order_that_changes_within_the_bounds_is_declined_with_one_clear_error():
    a, b = torch.export.Dim("a", min=2, max=40), torch.export.Dim("b", min=2, max=40)
    inputs = (torch.randn(1, 5), torch.randn(1, 9))
    program = torch.export.export(CutToShorter(), inputs, dynamic_shapes=({1: a}, {1: b}))
    code = program.graph_module.code
    with collect_decisions() as decisions, pytest.raises(SizeMinMaxUndecided) as raised:
        size_min_max_decided_over_the_bounds(program)
    assert program.graph_module.code == code
    (decision,) = [d for d in decisions if d.fold == FOLD]
    assert not decision.applied and decision.detail.startswith("which size is smaller changes")
    message = str(raised.value)
    assert "torch.sym_min(" in message and "(in 2..40)" in message
    with pytest.raises(SizeMinMaxUndecided):
        lower_xnnpack(program, [XnnpackPartitioner()], lower=to_edge_transform_and_lower)


@settings(max_examples=20, deadline=None)
@given(
    divisor=st.integers(1, 6),
    shift=st.integers(-8, 8),
    offset=st.integers(-3, 3),
    low=st.integers(10, 30),
    span=st.integers(1, 60),
)
def test_the_order_agrees_with_every_size_tried_by_hand(divisor, shift, offset, low, span):
    """a = L // d against b = (L + shift) // d + offset, over L in [low, low + span]."""
    length = torch.export.Dim("L", min=low, max=low + span)
    program = torch.export.export(
        torch.nn.Identity(), (torch.randn(low + span // 2),), dynamic_shapes=({0: length},)
    )
    size = next(n for n in program.graph.nodes if n.op == "placeholder").meta["val"].shape[0]
    a, b = size // divisor, (size + shift) // divisor + offset
    differences = {
        n // divisor - ((n + shift) // divisor + offset) for n in range(low, low + span + 1)
    }
    expected = "<=" if max(differences) <= 0 else ">=" if min(differences) >= 0 else None
    assert order_at_every_size(a, b) == expected


@pytest.fixture(scope="module", params=["etfold", "upstream"])
def lowered(request):
    """The min program through either entry point with etfold's partitioner."""
    lower = to_edge_transform_and_lower if request.param == "etfold" else upstream_lower
    return lower_xnnpack(
        _exported(), [XnnpackPartitioner()], lower=lower, keep_declared_bounds=True
    )


@settings(max_examples=4, deadline=None)
@given(length=st.integers(LOW, HIGH))
def test_the_lowered_program_matches_eager_at_generated_lengths(lowered, length):
    inputs = _signal(length)
    expected = eager_outputs(PooledAndConvolvedCut().eval(), inputs)
    assert_close(lowered.run(*inputs), expected, atol=1e-5, rtol=1e-5)


def test_the_lowered_program_runs_at_its_bounds(lowered):
    for length in (LOW, HIGH):
        inputs = _signal(length)
        expected = eager_outputs(PooledAndConvolvedCut().eval(), inputs)
        assert_close(lowered.run(*inputs), expected, atol=1e-5, rtol=1e-5)
