# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Layout ops, and where an axis goes through one, in both directions.

A layout op moves or regroups values without computing them: permute,
transpose and views (view, reshape, flatten, unflatten). Ops are recognized by
overload, an Edge op as the ATen overload it wraps (`graph_walk.underlying_op`),
never by name, so `view.dtype` (a bitcast) is not a view. Where an axis goes is
defined once, input to output (`axis_after_layout_op`); the other direction is
its inverse. Both answer None when the axis does not stay whole (a view that
splits or merges it) or when the shapes are not static.
"""

from __future__ import annotations

import enum

import torch
from torch.fx import Node

from etfold.exir.passes.graph_walk import underlying_op
from etfold.exir.passes.node_shapes import axis_index, static_shape


class Layout(enum.Enum):
    PERMUTE = "permute"
    TRANSPOSE = "transpose"
    VIEW = "view"


_aten = torch.ops.aten
LAYOUT_OPS: dict[object, Layout] = {
    _aten.permute.default: Layout.PERMUTE,
    _aten.permute_copy.default: Layout.PERMUTE,
    _aten.transpose.int: Layout.TRANSPOSE,
    _aten.transpose_copy.int: Layout.TRANSPOSE,
    _aten.t.default: Layout.TRANSPOSE,
    _aten.view.default: Layout.VIEW,
    _aten.reshape.default: Layout.VIEW,
    _aten._unsafe_view.default: Layout.VIEW,
    _aten.view_copy.default: Layout.VIEW,
    _aten.flatten.using_ints: Layout.VIEW,
    _aten.unflatten.int: Layout.VIEW,
}


def layout_kind(node: object) -> Layout | None:
    """Which layout op `node` calls (ATen or Edge), or None for any other node."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    return LAYOUT_OPS.get(underlying_op(node.target))


def is_layout(node: object) -> bool:
    return layout_kind(node) is not None


def axis_through_view(source: tuple[int, ...], result: tuple[int, ...], axis: int) -> int | None:
    """Where `axis` of `source` lands when a view reshapes `source` to `result`, if it
    stays whole: the same number of elements before it, and its own size, in both."""
    before = 1
    for size in source[:axis]:
        before *= size
    seen = 1
    for index, size in enumerate(result):
        if seen == before and size == source[axis]:
            return index
        seen *= size
    return None


def _transposed_pair(node: Node, rank: int) -> tuple[int, int]:
    dims = (0, 1) if len(node.args) < 3 else (int(node.args[1]), int(node.args[2]))
    return axis_index(dims[0], rank), axis_index(dims[1], rank)


def axis_after_layout_op(node: Node, axis: int | None) -> int | None:
    """The axis of a layout op's output that `axis` of its input becomes, whole; None
    when unknown (any other op, no static shapes, a view that splits or merges it)."""
    kind = layout_kind(node)
    if kind is None or axis is None or not isinstance(node.args[0], Node):
        return None
    source, result = static_shape(node.args[0]), static_shape(node)
    if source is None or result is None or not 0 <= axis < len(source):
        return None
    if kind is Layout.PERMUTE:
        return [d % len(source) for d in node.args[1]].index(axis)
    if kind is Layout.TRANSPOSE:
        first, second = _transposed_pair(node, len(source))
        return second if axis == first else first if axis == second else axis
    return axis_through_view(source, result, axis)


def axis_before_layout_op(node: Node, axis: int | None) -> int | None:
    """The axis of a layout op's input that becomes `axis` of its output whole; None
    when no axis does (see `axis_after_layout_op`)."""
    source = static_shape(node.args[0]) if is_layout(node) else None
    if source is None or axis is None:
        return None
    for candidate in range(len(source)):
        if axis_after_layout_op(node, candidate) == axis:
            return candidate
    return None
