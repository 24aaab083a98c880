# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A parameter-only weight that holds an op no backend lowers folds whatever its size."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils.parametrizations import orthogonal

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack.partition.weight_fold import FOLD
from etfold.backends.xnnpack.partition.weight_fold_plan import lowers_nowhere, plan_weight_folds
from etfold.backends.xnnpack.partition.weight_fold_seeds import seed_slots
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower as etfold_lower
from etfold.harness.xnnpack_runner import assert_close, lower_module_xnnpack


def _orthogonal_linear(**kwargs):
    torch.manual_seed(0)
    return orthogonal(torch.nn.Linear(96, 64), **kwargs).eval()


def _plan(module, inputs):
    slots = seed_slots(XnnpackPartitioner().target_partitioner_configs.values())
    return plan_weight_folds(torch.export.export(module, inputs), slots)


def test_householder_orthogonal_counts_one_source_for_one_weight():
    plan = _plan(_orthogonal_linear(use_trivialization=False), (torch.randn(2, 96),))
    (group,) = plan.groups
    assert not plan.declined
    assert group.added_bytes == group.erased_bytes == 64 * 96 * 4
    assert group.must_fold == ("aten.linalg_householder_product.default",)


def test_householder_orthogonal_lowers_to_one_delegate_and_matches_eager():
    x = torch.randn(3, 96)
    with collect_decisions() as decisions:
        program, reference = lower_module_xnnpack(
            _orthogonal_linear(use_trivialization=False),
            (x,),
            [XnnpackPartitioner()],
            lower=etfold_lower,
        )
    assert program.delegates() == 1 and not program.ops_outside()
    assert_close(program.run(x), reference, atol=1e-5)
    (applied,) = [d.detail for d in decisions if d.fold == FOLD and d.applied]
    assert "linalg_householder_product" in applied and "no backend" in applied


@pytest.mark.parametrize("orthogonal_map", ["matrix_exp", "cayley"])
def test_trivialized_orthogonal_maps_fold_by_the_size_rule(orthogonal_map):
    """Core-ATen parametrizations keep the size rule: no forced fold is recorded."""
    module = _orthogonal_linear(orthogonal_map=orthogonal_map)
    plan = _plan(module, (torch.randn(2, 96),))
    assert all(not g.must_fold for g in plan.groups)


def test_core_and_decomposable_ops_are_not_unlowerable():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    core = graph.call_function(torch.ops.aten.add.Tensor, (x, x))
    decomposed = graph.call_function(torch.ops.aten.tril.default, (x,))
    householder = graph.call_function(torch.ops.aten.linalg_householder_product.default, (x, x))
    assert not lowers_nowhere(core) and not lowers_nowhere(decomposed)
    assert lowers_nowhere(householder)
