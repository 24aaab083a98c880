# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Layout ops by overload (ATen and Edge), and an axis through them in both directions,
checked against where the values actually go."""

from __future__ import annotations

import pytest
import torch
from executorch.exir import to_edge
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.arm._passes.layout_axes import (
    Layout,
    axis_after_layout_op,
    axis_before_layout_op,
    is_layout,
    layout_kind,
)
from etfold.exir.passes.node_shapes import rank_of, static_shape


class Tail(torch.nn.Module):
    def __init__(self, tail):
        super().__init__()
        self.tail = tail

    def forward(self, x):
        return self.tail(x)


def _layout_node(tail, shape, edge=False):
    program = torch.export.export(Tail(tail), (torch.randn(*shape),))
    if edge:
        program = to_edge(program).exported_program()
    (node,) = [n for n in program.graph.nodes if n.op == "call_function"]
    return node


def _moved_axis(tail, shape, axis):
    """Where `axis` goes, found from the values: tag it with its index, run the tail."""
    tagged = torch.zeros(shape)
    index = [None if d != axis else slice(None) for d in range(len(shape))]
    tagged = tagged + torch.arange(shape[axis], dtype=torch.float32)[tuple(index)]
    out = tail(tagged)
    for candidate in range(out.dim()):
        if out.shape[candidate] != shape[axis]:
            continue
        expected = torch.arange(shape[axis], dtype=torch.float32)
        view = [1] * out.dim()
        view[candidate] = shape[axis]
        if torch.equal(out, expected.reshape(view).expand(out.shape)):
            return candidate
    return None


_TAILS = {
    "permute": (lambda y: y.permute(0, 2, 3, 1), Layout.PERMUTE),
    "permute_negative": (lambda y: y.permute(0, -1, 1, 2), Layout.PERMUTE),
    "transpose": (lambda y: y.transpose(1, 3), Layout.TRANSPOSE),
    "reshape": (lambda y: y.reshape(2, 3, 20), Layout.VIEW),
    "flatten": (lambda y: y.flatten(2), Layout.VIEW),
    "unflatten": (lambda y: y.unflatten(2, (2, 2)), Layout.VIEW),
}


@pytest.mark.parametrize("edge", [False, True], ids=["aten", "edge"])
@pytest.mark.parametrize("name", list(_TAILS))
def test_axis_goes_where_the_values_go_both_ways(name, edge):
    tail, kind = _TAILS[name]
    shape = (2, 3, 4, 5)
    node = _layout_node(tail, shape, edge)
    assert layout_kind(node) is (Layout.PERMUTE if edge and kind is Layout.TRANSPOSE else kind)
    for axis in range(len(shape)):
        moved = _moved_axis(tail, shape, axis)
        assert axis_after_layout_op(node, axis) == moved, axis
        if moved is not None:
            assert axis_before_layout_op(node, moved) == axis


def test_a_view_that_merges_the_axis_keeps_it_nowhere():
    node = _layout_node(lambda y: y.reshape(2, 12, 5), (2, 3, 4, 5))
    assert axis_after_layout_op(node, 1) is None
    assert axis_before_layout_op(node, 1) is None
    assert axis_after_layout_op(node, 3) == 2 and axis_before_layout_op(node, 2) == 3


def test_a_bitcast_view_and_other_ops_are_not_layout_ops():
    bitcast = _layout_node(lambda y: y.view(torch.int32), (2, 3))
    relu = _layout_node(torch.relu, (2, 3))
    for node in (bitcast, relu):
        assert not is_layout(node) and layout_kind(node) is None
        assert axis_after_layout_op(node, 1) is None and axis_before_layout_op(node, 1) is None


def test_no_axis_without_static_shapes():
    node = _layout_node(lambda y: y.permute(0, 2, 1), (2, 3, 4))
    del node.meta["val"]
    assert static_shape(node) is None and rank_of(node) is None
    assert axis_after_layout_op(node, 1) is None and axis_before_layout_op(node, 2) is None


@settings(max_examples=30, deadline=None)
@given(order=st.permutations(range(4)))
def test_generated_permutes_match_the_values(order):
    shape = (2, 3, 4, 5)
    node = _layout_node(lambda y: y.permute(*order), shape)
    for axis in range(4):
        moved = _moved_axis(lambda y: y.permute(*order), shape, axis)
        assert axis_after_layout_op(node, axis) == moved
        assert axis_before_layout_op(node, moved) == axis
