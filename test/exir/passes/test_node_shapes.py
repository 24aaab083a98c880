# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""static_shape and rank_of: read from meta["val"]; a symbolic size is no static shape.
node_value and shapes_known_equal: any value, and shapes equal at every size."""

from __future__ import annotations

import torch

from etfold.exir.passes.node_shapes import node_value, rank_of, shapes_known_equal, static_shape


class Double(torch.nn.Module):
    def forward(self, x):
        return x * 2


def _mul(program):
    (node,) = [n for n in program.graph.nodes if n.op == "call_function"]
    return node


def test_static_program_has_shape_and_rank():
    node = _mul(torch.export.export(Double(), (torch.randn(2, 3),)))
    assert static_shape(node) == (2, 3) and rank_of(node) == 2


def test_dynamic_size_has_rank_but_no_static_shape():
    batch = torch.export.Dim("batch", min=2)
    program = torch.export.export(Double(), (torch.randn(2, 3),), dynamic_shapes=({0: batch},))
    node = _mul(program)
    assert static_shape(node) is None and rank_of(node) == 2


def test_no_tensor_value_has_neither():
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    assert static_shape(node) is None and rank_of(node) is None
    node.meta["val"] = 3
    assert static_shape(node) is None and rank_of(node) is None
    assert static_shape(7) is None and rank_of(None) is None


def test_node_value_is_any_value_and_none_off_a_node():
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    assert node_value(node) is None and node_value(3) is None
    node.meta["val"] = 3
    assert node_value(node) == 3


def test_shapes_known_equal_at_every_size():
    batch = torch.export.Dim("batch", min=2)
    program = torch.export.export(Double(), (torch.randn(2, 3),), dynamic_shapes=({0: batch},))
    shape = node_value(_mul(program)).shape
    assert shapes_known_equal(shape, shape) and shapes_known_equal((2, 3), [2, 3])
    assert not shapes_known_equal(shape, (2, 3))  # the batch is 2 at one size only
    assert not shapes_known_equal(shape, shape[1:])
