# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Write a chain of relu / relu6 / hardtanh as the one clamp it computes.

Given:   y = clamp(clamp(x, a1, b1), a2, b2)       each a relu, relu6 or hardtanh;
                                                    the inner one read only by the outer
Result:  y = hardtanh(x, max(a1, a2), min(b1, b2))  the ranges overlap
         y = hardtanh(x, v, v)                      else: v = a2 if b1 < a2, else b2
         (a result of (0, inf) is written as relu)

Why: XNNPACK's `FuseActivationPass` fuses a relu or hardtanh into the conv, linear
or arithmetic op before it by writing that op's output range. The next activation
of a chain then finds the same op before it and writes its own range over the
first one's instead of narrowing it: `hardtanh(relu6(conv(x)), -1.5, 1)` ran as
`clamp(conv(x), -1.5, 1)`. One activation per chain is fused once.

Exact: clamping into [a1, b1] and then into [a2, b2] clamps into the overlap, and
where they do not overlap every value ends on the bound of [a2, b2] nearest
[a1, b1]. A NaN passes every clamp unchanged either way.

Declines: bounds that are not numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from etfold.decisions import Declined, record_applied
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import node_value

FOLD = "xnnpack.clamp_chains_as_one"

aten = torch.ops.aten
_DEFAULT_RANGES = {
    aten.relu.default: (0.0, math.inf),
    aten.relu6.default: (0.0, 6.0),
    aten.hardtanh.default: (-1.0, 1.0),
}


def clamp_range(node: Node) -> tuple[float, float] | Declined | None:
    """The range a relu, relu6 or hardtanh clamps a float tensor into; None for any other node."""
    if node.op != "call_function" or node.target not in _DEFAULT_RANGES:
        return None
    value = node_value(node)
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        return None
    low, high = _DEFAULT_RANGES[node.target]
    if node.target is aten.hardtanh.default:
        low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min_val", low)
        high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max_val", high)
    if not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in (low, high)):
        return Declined(f"`{node.name}`'s bounds are not numbers")
    return float(low), float(high)


def _single_clamp_reader(node: Node) -> Node | None:
    readers = list(node.users)
    return readers[0] if len(readers) == 1 and clamp_range(readers[0]) is not None else None


def _is_clamp_read_only_by(value, reader: Node) -> bool:
    return (
        isinstance(value, Node) and clamp_range(value) is not None and list(value.users) == [reader]
    )


@dataclass(frozen=True)
class ClampChain:
    source: Node  # what the first clamp reads
    links: tuple[Node, ...]  # the clamps, first to last
    low: float
    high: float


def match_clamp_chain(node: Node) -> ClampChain | Declined | None:
    """A chain ending at `node`: it is a clamp no single clamp reads, and the clamp it
    reads is read by it alone."""
    if clamp_range(node) is None or _single_clamp_reader(node) is not None:
        return None
    links = [node]
    while _is_clamp_read_only_by(links[0].args[0], links[0]):
        links.insert(0, links[0].args[0])
    if len(links) < 2:
        return None
    ranges = [clamp_range(link) for link in links]
    if declined := next((r for r in ranges if isinstance(r, Declined)), None):
        return declined
    low, high = ranges[0]
    for next_low, next_high in ranges[1:]:
        low, high = _clamped_twice(low, high, next_low, next_high)
    return ClampChain(links[0].args[0], tuple(links), low, high)


def _clamped_twice(a1: float, b1: float, a2: float, b2: float) -> tuple[float, float]:
    low, high = max(a1, a2), min(b1, b2)
    if low <= high:
        return low, high
    value = a2 if b1 < a2 else b2
    return value, value


def write_as_one_clamp(chain: ClampChain) -> None:
    last = chain.links[-1]
    graph = last.graph
    with graph.inserting_before(last):
        if (chain.low, chain.high) == (0.0, math.inf):
            clamp = graph.call_function(aten.relu.default, (chain.source,))
        else:
            clamp = graph.call_function(
                aten.hardtanh.default, (chain.source, chain.low, chain.high)
            )
    clamp.meta = dict(last.meta)
    last.replace_all_uses_with(clamp)
    for link in reversed(chain.links):
        graph.erase_node(link)
    names = ", ".join(link.name for link in chain.links)
    record_applied(FOLD, last.name, f"{names} as one clamp to [{chain.low}, {chain.high}]")


def clamp_chains_as_one(program: ExportedProgram) -> ExportedProgram:
    """`program` itself when no chain of clamps is found; else a copy with each written
    as one clamp."""
    return rewrite_matches_on_a_copy(program, match_clamp_chain, write_as_one_clamp, FOLD)
