# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A copy XNNPACK drops never leaves a delegate beside the value it copies."""

from __future__ import annotations

import functools

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack.partition.dropped_copies import FOLD
from etfold.decisions import collect_decisions
from etfold.harness.dynamic_shapes import lower_dynamic
from etfold.harness.xnnpack_runner import lower_module_xnnpack

CLONE = "dim_order_ops._clone_dim_order.default"


class CopyBeside(torch.nn.Module):
    """The linear's output and its copy are both read by ops XNNPACK does not take."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        return torch.cumsum(y.clone(), -1) + torch.cumsum(y, 0)


class CopyInside(torch.nn.Module):
    """The copy leaves the delegate; what it copies does not."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.cumsum(torch.relu(self.linear(x)).clone(), -1)


class CopyOfAnInput(torch.nn.Module):
    def forward(self, x):
        return torch.cumsum(torch.cumsum(x, 0).clone(), -1)


def _lower(module, x, partitioner):
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(module, (x,), [partitioner])
    return program, expected, [d for d in decisions if d.fold == FOLD]


def test_a_copy_beside_its_source_stays_outside_where_stock_fails_to_lower():
    torch.manual_seed(0)
    module, x = CopyBeside().eval(), torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="already in the inputs"):
        lower_module_xnnpack(module, (x,), [UpstreamXnnpackPartitioner()])
    program, expected, decisions = _lower(module, x, XnnpackPartitioner())
    assert [(d.applied, d.detail) for d in decisions] == [
        (
            False,
            "copies `aten_linear_default`, which leaves the delegate too; inside, the copy "
            "would be dropped and the delegate return one value twice",
        )
    ]
    assert program.ops_outside()[CLONE] == 1
    torch.testing.assert_close(program.run(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("module", [CopyInside, CopyOfAnInput], ids=["inside", "of_an_input"])
def test_a_copy_whose_source_stays_inside_or_comes_in_is_lowered_as_stock_lowers_it(module):
    torch.manual_seed(0)
    module, x = module().eval(), torch.randn(3, 4)
    program, expected, decisions = _lower(module, x, XnnpackPartitioner())
    stock, _, _ = _lower(module, x, UpstreamXnnpackPartitioner())
    assert decisions == []
    assert (program.delegates(), program.ops_outside()) == (stock.delegates(), stock.ops_outside())
    torch.testing.assert_close(program.run(x), expected, atol=1e-5, rtol=1e-5)


@functools.cache
def _dynamic_copy_beside():
    torch.manual_seed(0)
    module = CopyBeside().eval()
    program, decisions = lower_dynamic(
        module,
        (torch.randn(5, 4),),
        ({0: torch.export.Dim("rows", min=2, max=16)},),
        [XnnpackPartitioner()],
    )
    return module, program, decisions


@pytest.mark.parametrize("rows", [2, 9, 16], ids=["min", "between", "max"])
def test_a_dynamic_copy_beside_its_source_matches_eager_at_each_size(rows):
    module, program, decisions = _dynamic_copy_beside()
    assert [d.applied for d in decisions if d.fold == FOLD] == [False]
    x = torch.randn(rows, 4)
    torch.testing.assert_close(program.run(x)[0], module(x), atol=1e-5, rtol=1e-5)
