# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The weight fold asks `constant_prop.verdicts` whether a source may fold: where its own
verdict used to differ (a non-plain tensor source), it now declines like constant_prop_pass."""

from __future__ import annotations

import torch
from torch.nn.utils.parametrizations import weight_norm

from etfold.backends.xnnpack.partition.weight_fold_plan import plan_weight_folds
from etfold.backends.xnnpack.partition.weight_fold_seeds import seed_slots
from etfold.exir.passes.constant_prop_pass import constant_prop_pass


class Marked(torch.Tensor):
    pass


def _program():
    torch.manual_seed(0)
    module = weight_norm(torch.nn.Linear(8, 4)).eval()
    return torch.export.export(module, (torch.randn(2, 8),))


def _slots():
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS

    return seed_slots(config() for config in ALL_PARTITIONER_CONFIGS)


def test_plans_the_weight_norm_weight():
    plan = plan_weight_folds(_program(), _slots())
    assert [c.seed.where for g in plan.groups for c in g.closures] == ["linear.weight"]


def test_declines_a_non_plain_tensor_source_as_constant_prop_pass_does():
    program = _program()
    fqn = "parametrizations.weight.original1"
    program.state_dict[fqn] = program.state_dict[fqn].detach().as_subclass(Marked)
    plan = plan_weight_folds(program, _slots())
    assert not plan.groups
    [(seed, reason)] = [(s, r) for s, r in plan.declined if s.position == "weight"]
    assert f"`{fqn}` is not a plain tensor (Marked)" in reason
    before = str(program.graph)
    constant_prop_pass(program, register_like_source=True)
    assert str(program.graph) == before
