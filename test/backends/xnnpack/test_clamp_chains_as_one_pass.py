# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A chain of relu / relu6 / hardtanh after a conv runs as the one clamp it computes.

Stock XNNPACK fuses each activation of such a chain into the conv in turn, the
last one's range replacing the first's: `hardtanh(relu6(conv(x)), -1.5, 1)` ran
as `clamp(conv(x), -1.5, 1)`.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.clamp_chains_as_one_pass import (
    FOLD,
    _clamped_twice,
    clamp_chains_as_one,
)
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.xnnpack_runner import lower_module_xnnpack, max_abs_error

ACTIVATIONS = {
    "relu": (F.relu, (0.0, math.inf)),
    "relu6": (F.relu6, (0.0, 6.0)),
    "hardtanh": (lambda y: F.hardtanh(y, -1.5, 1.0), (-1.5, 1.0)),
    "high": (lambda y: F.hardtanh(y, 7.0, 9.0), (7.0, 9.0)),
}


class ConvThenClamps(torch.nn.Module):
    def __init__(self, chain):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 2, 3, padding=1)
        self.chain = chain

    def forward(self, x):
        y = self.conv(x)
        for name in self.chain:
            y = ACTIVATIONS[name][0](y)
        return y


def _lowered_error(chain, partitioner, lower=None):
    torch.manual_seed(0)
    module, x = ConvThenClamps(chain).eval(), 3 * torch.randn(1, 2, 5, 5)
    kwargs = {"lower": lower} if lower else {}
    program, reference = lower_module_xnnpack(module, (x,), [partitioner], **kwargs)
    return max_abs_error(program.run(x), reference), program


@pytest.mark.parametrize(
    "chain", [("relu6", "hardtanh"), ("hardtanh", "relu"), ("relu6", "high"), ("relu", "relu6")]
)
def test_a_chain_after_a_conv_matches_eager(chain):
    with collect_decisions() as decisions:
        error, program = _lowered_error(chain, XnnpackPartitioner(), to_edge_transform_and_lower)
    assert error <= 1e-5
    assert program.delegates() == 1 and not program.ops_outside()
    assert [d.applied for d in decisions if d.fold == FOLD] == [True]


def test_stock_runs_the_last_range_only():
    """The upstream wrong program this pass exists for; when it passes, upstream is fixed."""
    error, _ = _lowered_error(("relu6", "hardtanh"), UpstreamXnnpackPartitioner())
    assert error > 1.0


def test_a_clamp_read_twice_is_left_alone():
    class ReadTwice(torch.nn.Module):
        def forward(self, x):
            y = F.relu6(x)
            return F.hardtanh(y, -1.5, 1.0), y

    program = torch.export.export(ReadTwice(), (torch.randn(4),))
    assert clamp_chains_as_one(program) is program


def test_the_users_program_is_only_read():
    program = torch.export.export(ConvThenClamps(("relu6", "hardtanh")), (torch.randn(1, 2, 5, 5),))
    before = str(program.graph)
    rewritten = clamp_chains_as_one(program)
    assert rewritten is not program and str(program.graph) == before
    targets = [n.target for n in rewritten.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.hardtanh.default) == 1


bounds = st.floats(-8, 8, allow_nan=False).flatmap(
    lambda a: st.tuples(st.just(a), st.floats(a, 8, allow_nan=False))
)


@settings(max_examples=200, deadline=None)
@given(bounds, bounds, st.lists(st.floats(-20, 20, allow_nan=False), min_size=1, max_size=8))
def test_two_clamps_compose_into_the_computed_one(first, second, values):
    x = torch.tensor(values, dtype=torch.float64)
    twice = x.clamp(*first).clamp(*second)
    low, high = _clamped_twice(*first, *second)
    assert torch.equal(x.clamp(low, high), twice)
