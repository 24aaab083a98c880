# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Twin layers (one product computed twice) and whether two values ever meet.

Two calls of one conv or linear op that read the same input and the same weight,
with the same stride, padding and groups, compute the same product whatever
their biases. A scale fold asks for a layer's twins and whether a twin's result
meets the scaled one downstream, where a rounding they share could cancel.
"""

from __future__ import annotations

from dataclasses import replace

from torch.fx import Node

from etfold.backends.arm._passes.conv_arguments import ConvArguments, conv_arguments
from etfold.decisions import Declined


def _same_tensor(a, b) -> bool:
    """Two arguments that read one tensor: the same node, or get_attrs of one attribute."""
    if a is b:
        return True
    both_attrs = isinstance(a, Node) and isinstance(b, Node) and a.op == b.op == "get_attr"
    return both_attrs and a.target == b.target


def _without_operands(arguments: ConvArguments) -> ConvArguments:
    return replace(arguments, node=None, weight=None, bias=None)


def twin_layers(layer: Node) -> list[Node]:
    """Other calls of `layer`'s op on the same input and the same weight, with the same
    stride, padding and groups (the bias may differ): the same product computed again."""
    mine = conv_arguments(layer)
    if isinstance(mine, Declined) or not isinstance(mine.input, Node):
        return []
    twins = []
    for other in mine.input.users:
        theirs = conv_arguments(other) if other is not layer else None
        if not isinstance(theirs, ConvArguments) or other.target != layer.target:
            continue
        same_operands = theirs.input is mine.input and _same_tensor(theirs.weight, mine.weight)
        if same_operands and _without_operands(theirs) == _without_operands(mine):
            twins.append(other)
    return twins


def descendants(node: Node) -> set[Node]:
    """Every node computed from `node`'s value (the graph output excluded)."""
    found: set[Node] = set()
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if user.op != "output" and user not in found:
                found.add(user)
                stack.append(user)
    return found


def meet(a: Node, b: Node) -> bool:
    """Whether some node computes from both `a` and `b` (returning both is no meeting)."""
    return bool(({a} | descendants(a)) & ({b} | descendants(b)))
