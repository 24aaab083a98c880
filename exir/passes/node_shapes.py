# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A node's fake value (meta["val"]), and the shape and rank read from it.

Every read of a node's fake value goes through `node_value` (any value),
`tensor_value` (a tensor, else None) or `argument_values` (an op's arguments with
their nodes replaced by their values, to run the op on fake values). A matcher
that needs sizes asks `static_shape`, which answers only when every size is a
plain int: a symbolic size is a dynamic shape, and the folds decline those rather
than guess. `rank_of` needs no sizes, only the tensor. A rewrite that
holds on dynamic shapes reads `node_value` and compares with `shapes_known_equal`.
Which axis an op's dim argument names: `axis_index`, `is_last_axis`.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from etfold.exir.passes.graph_walk import call_with_value, sizes_known_equal


def node_value(node: object) -> object:
    """The node's fake value (meta["val"]: a tensor, a SymInt, ..); None for a non-node
    or a node without one."""
    return node.meta.get("val") if isinstance(node, Node) else None


def shapes_known_equal(a, b) -> bool:
    """Same rank, and each pair of sizes known equal at every size the bounds allow."""
    return len(a) == len(b) and all(sizes_known_equal(x, y) for x, y in zip(a, b, strict=True))


def tensor_value(node: object) -> torch.Tensor | None:
    """The node's fake value when it is a tensor; None otherwise (no value, a SymInt, a
    multi-output op's list, a non-node)."""
    value = node_value(node)
    return value if isinstance(value, torch.Tensor) else None


def argument_values(arguments: object) -> object:
    """`arguments` (an op's args, kwargs, or one argument) with every node in them, at any
    depth of lists, tuples and dicts, replaced by its fake value: what the op takes when
    run on fake values to give a new node its value."""
    return torch.fx.node.map_aggregate(
        arguments, lambda a: node_value(a) if isinstance(a, Node) else a
    )


def call_on_values(
    graph: torch.fx.Graph,
    target,
    args: tuple,
    kwargs: dict | None = None,
    meta: dict | None = None,
) -> Node:
    """`target(*args, **kwargs)` at the graph's insertion point, its value the op run on
    its arguments' fake values (`argument_values`), with a copy of `meta` as
    `call_with_value` gives it. For ops that keep a symbolic size symbolic (views,
    elementwise ops, reductions): a copy op's meta function may fix one, which the
    rewrite driver refuses (`SizeFixedByRewrite`)."""
    value = target(*argument_values(args), **(kwargs or {}))
    return call_with_value(graph, target, args, value, meta, kwargs)


def static_shape(node: object) -> tuple[int, ...] | None:
    """The node's shape when its value is a tensor of plain-int sizes; else None."""
    return static_shape_of_value(tensor_value(node))


def static_shape_of_value(value: object) -> tuple[int, ...] | None:
    """A (fake) tensor's shape when its sizes are plain ints; else None (one piece of a
    multi-output node's value, e.g. a split's)."""
    if not isinstance(value, torch.Tensor) or not all(type(s) is int for s in value.shape):
        return None
    return tuple(value.shape)


def axis_index(dim: int, rank: int) -> int:
    """The axis an op's `dim` argument names among `rank` axes, a negative dim counting
    from the end (-1 is `rank - 1`)."""
    return dim % rank


def is_last_axis(dim: object, rank: int) -> bool:
    """An op's `dim` argument names the last of `rank` axes (-1 or `rank - 1`): the one
    answer to "is this the last axis"."""
    return type(dim) is int and rank > 0 and axis_index(dim, rank) == rank - 1


def rank_of(node: object) -> int | None:
    """The number of dimensions of the node's tensor value; None when it has none."""
    value = tensor_value(node)
    return None if value is None else value.dim()
