# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""One set of last-axis normalizations serves both layout guards, in ATen and Edge form."""

from __future__ import annotations

import operator

import pytest
import torch
from executorch.exir import to_edge

from etfold.backends.xnnpack._passes.last_axis_normalizations import (
    LAST_AXIS_NORMALIZATIONS,
    normalizes_along_memory_axis,
)
from etfold.backends.xnnpack._passes.last_axis_ops_read_nchw import LAST_AXIS_OPS
from etfold.exir.passes.graph_walk import underlying_op

F = torch.nn.functional


class Normalize(torch.nn.Module):
    def __init__(self, op: str):
        super().__init__()
        self.op = op

    def forward(self, x):
        if self.op == "softmax":
            return torch.softmax(x, -1)
        if self.op == "log_softmax":
            return torch.log_softmax(x, -1)
        if self.op == "layer_norm":
            return F.layer_norm(x, x.shape[-1:])
        return torch.tanh(x)


def _targets(program) -> list:
    """The program's op nodes, without the getitems of a multi-output op."""
    nodes = program.graph_module.graph.nodes
    return [n for n in nodes if n.op == "call_function" and n.target is not operator.getitem]


@pytest.mark.parametrize("op", ["softmax", "log_softmax", "layer_norm", "tanh"])
def test_aten_and_edge_forms_of_an_op_get_one_answer(op):
    program = torch.export.export(Normalize(op), (torch.randn(1, 2, 3, 4),))
    aten_nodes = _targets(program)
    edge_nodes = _targets(to_edge(program).exported_program())
    expected = op != "tanh"
    assert [normalizes_along_memory_axis(n) for n in aten_nodes] == [expected]
    assert [normalizes_along_memory_axis(n) for n in edge_nodes] == [expected]
    assert (edge_nodes[0].target in LAST_AXIS_OPS) is expected


def test_the_delegate_guard_adds_the_edge_form_of_every_op_in_the_set():
    assert {underlying_op(op) for op in LAST_AXIS_OPS} == LAST_AXIS_NORMALIZATIONS
