# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""static_shape and rank_of: read from meta["val"]; a symbolic size is no static shape.
node_value, tensor_value, argument_values and shapes_known_equal: any value, a tensor
value, an op's arguments as values, and shapes equal at every size. axis_index and
is_last_axis: which axis an op's dim argument names."""

from __future__ import annotations

import torch

from etfold.exir.passes.node_shapes import (
    argument_values,
    axis_index,
    is_last_axis,
    node_value,
    rank_of,
    shapes_known_equal,
    static_shape,
    tensor_value,
)


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


def test_tensor_value_is_a_tensor_or_none():
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    assert tensor_value(node) is None and tensor_value(torch.ones(1)) is None
    node.meta["val"] = 3
    assert tensor_value(node) is None
    node.meta["val"] = [torch.ones(1)]  # a multi-output op's value
    assert tensor_value(node) is None
    node.meta["val"] = value = torch.ones(2)
    assert tensor_value(node) is value


def test_argument_values_replace_nodes_at_any_depth_and_keep_the_rest():
    graph = torch.fx.Graph()
    x, size = graph.placeholder("x"), graph.placeholder("size")
    x.meta["val"], size.meta["val"] = torch.ones(2, 3), 6
    args = (x, [size, -1], {"dim": (size, 0)}, None, "text")
    first, shape, options, none, text = argument_values(args)
    assert first is x.meta["val"] and list(shape) == [6, -1] and options == {"dim": (6, 0)}
    assert none is None and text == "text" and argument_values(x) is x.meta["val"]
    assert torch.ops.aten.view.default(*argument_values((x, [size]))).shape == (6,)


def test_argument_values_of_a_node_without_a_value_is_none():
    graph = torch.fx.Graph()
    assert argument_values([graph.placeholder("x"), 2]) == [None, 2]


def test_a_negative_dim_counts_from_the_end():
    assert [axis_index(d, 3) for d in (-3, -2, -1, 0, 1, 2)] == [0, 1, 2, 0, 1, 2]


def test_the_last_axis_is_minus_one_or_rank_minus_one_and_nothing_else():
    for rank in (1, 2, 4):
        last = [d for d in range(-rank, rank) if is_last_axis(d, rank)]
        assert last == [-1, rank - 1] if rank > 1 else last == [-1, 0]
    assert not is_last_axis(None, 2) and not is_last_axis([1], 2) and not is_last_axis(True, 2)
    assert not is_last_axis(0, 0)  # a rank-0 tensor has no axis
