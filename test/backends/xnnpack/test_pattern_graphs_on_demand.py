# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""XNNPACK's preprocess builds its match patterns only for a graph they could match.

The suite runs without the speed-ups (test/conftest.py); a fresh interpreter checks
the bytes of a lowering that never built the patterns (test_torch_speedups.py).
"""

import importlib
import inspect

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower

from etfold.backends.xnnpack.pattern_graphs_on_demand import (
    PATCH,
    PATTERN_USERS,
    holds_op,
    patterns_on_demand,
)
from etfold.exir.program.speedups import registered_speedups

IDS = [user.pass_class for user in PATTERN_USERS]


@pytest.mark.parametrize("user", PATTERN_USERS, ids=IDS)
def test_every_upstream_pattern_holds_the_op_a_graph_must_hold_to_match(user):
    patterns = getattr(importlib.import_module(user.patterns_module), user.patterns_function)()
    assert isinstance(patterns, user.no_patterns) and len(patterns) > 0
    assert all(holds_op(pattern.graph, user.anchor_op()) for pattern in patterns)


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        weights = torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1)
        return weights @ v


class Upsample(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.interpolate(x, scale_factor=2, mode="bilinear") + 1


def _pattern_lookups() -> int:
    """How often upstream's cached pattern builders have been asked, built or not."""
    from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa

    builders = (
        inspect.unwrap(sdpa.get_graphs, stop=lambda f: hasattr(f, "cache_info")),
        bilinear_2d._get_bilinear_2d_graphs,
    )
    return sum(info.hits + info.misses for info in (b.cache_info() for b in builders))


def _lower(module, inputs):
    program = torch.export.export(module.eval(), inputs)
    return to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])


def test_a_graph_without_the_ops_lowers_without_asking_for_patterns():
    before = _pattern_lookups()
    with patterns_on_demand():
        conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
        lowered = _lower(conv, (torch.randn(1, 3, 8, 8),))
    assert _pattern_lookups() == before
    assert lowered.exported_program().graph_module.lowered_module_0.processed_bytes


@pytest.mark.parametrize(
    "module, inputs, target",
    [
        (Attention(), tuple(torch.randn(1, 2, 4, 8) for _ in range(3)), "sdpa"),
        (Upsample(), (torch.randn(1, 3, 4, 4),), "upsample_bilinear2d"),
    ],
    ids=["softmax", "upsample_bilinear2d"],
)
def test_a_graph_holding_the_op_is_matched_against_upstreams_patterns(module, inputs, target):
    before = _pattern_lookups()
    with patterns_on_demand():
        lowered = _lower(module, inputs)
    assert _pattern_lookups() == before + 1
    assert lowered.exported_program().graph_module.lowered_module_0.processed_bytes


def test_inside_the_scope_upstream_is_wrapped_and_etfolds_speedups_enter_it():
    with patterns_on_demand():
        for user in PATTERN_USERS:
            call = getattr(importlib.import_module(user.pass_module), user.pass_class).call
            patterns = getattr(
                importlib.import_module(user.patterns_module), user.patterns_function
            )
            assert call.__wrapped__ is not call and patterns.__wrapped__ is not patterns
    assert PATCH in registered_speedups()
