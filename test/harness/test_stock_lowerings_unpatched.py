# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Under the suite's `ETFOLD_SPEEDUPS=etfold`, the harness lowers etfold's programs with
the speed-ups, as users get them, and every stock baseline without: the speed-ups are
read while each lowering runs (a partitioner asks which are acting)."""

from __future__ import annotations

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as StockPartitioner,
)

from etfold.backends.arm import arm_folds_registered
from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.exir import to_edge_transform_and_lower
from etfold.exir.program.speedups import active_speedups
from etfold.harness import tosa_runner
from etfold.harness.xnnpack_runner import is_stock_lowering, lower_xnnpack


class Spy(StockPartitioner):
    """Upstream's partitioner that notes the speed-ups acting when it partitions."""

    seen: list[list[str]] = []

    def partition(self, program):
        Spy.seen.append(active_speedups())
        return super().partition(program)


Spy.__module__ = StockPartitioner.__module__  # upstream's own, as far as the harness asks


def _program():
    return torch.export.export(torch.nn.Linear(4, 4).eval(), (torch.randn(2, 4),))


@pytest.fixture(autouse=True)
def _suite_switch(monkeypatch):
    monkeypatch.setenv("ETFOLD_SPEEDUPS", "etfold")
    Spy.seen.clear()


def test_a_stock_lowering_runs_unpatched_and_etfolds_with_the_speedups():
    lower_xnnpack(_program(), [Spy()])
    lower_xnnpack(_program(), [Spy()], lower=to_edge_transform_and_lower)
    stock, etfold = Spy.seen
    assert stock == [] and etfold, (stock, etfold)


def test_the_harness_names_stock_what_holds_nothing_of_etfolds():
    from executorch.exir import to_edge_transform_and_lower as upstream

    assert is_stock_lowering(upstream, [StockPartitioner()])
    assert not is_stock_lowering(upstream, [XnnpackPartitioner()])
    assert not is_stock_lowering(to_edge_transform_and_lower, [StockPartitioner()])
    assert not is_stock_lowering(upstream, None)  # the harness's default: etfold's
    assert tosa_runner.is_stock_arm_lowering(upstream)
    with arm_folds_registered():
        assert not tosa_runner.is_stock_arm_lowering(upstream)


def test_the_entry_points_scope_inside_the_harnesss_is_sound():
    """The harness's scope installs the patches; etfold's entry point opens its own inside
    it, over attributes that are the patches' own: sound, so it says nothing (a
    `SpeedupsOffWarning` here would tell users their speed-ups are off when they are on)."""
    from etfold.exir.program.speedups import every_speedup, torch_speedups, why_unavailable

    assert why_unavailable(every_speedup()) is None
    with torch_speedups(True):
        assert active_speedups()
        assert why_unavailable(every_speedup()) is None
    lower_xnnpack(_program(), [Spy()], lower=to_edge_transform_and_lower)
    assert Spy.seen and Spy.seen[0]
