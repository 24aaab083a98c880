# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Write the min or max of two sizes as the one it is at every size the bounds allow.

Given:   n = torch.sym_min(a, b)        (or torch.sym_max), a and b sizes
Where:   a <= b for every size the export's bounds allow (or a >= b)
Result:  n = a                          (the min; the max is b; mirrored for >=)

A model that cuts two sequences to the shorter one (`min(x.size(-1), y.size(-1))`)
exports `torch.sym_min` once its length is dynamic. ExecuTorch 1.5.1's Edge verifier
refuses every Python function but `alloc`, so `to_edge` raises a bare AssertionError
and the program never lowers, on stock as on etfold. Often the two lengths are
the same function of the input's length written two ways (SEW's pooled and
positional lengths, `(L//20 - 1)//2` and `(L//20 - 3)//2 + 1`), which torch cannot
prove equal; `graph_walk.order_at_every_size` then tries every allowed length.

Declines: an order that changes within the bounds, bounds too wide to try one by
one, a number operand. A declined op that is read would meet the verifier's bare
AssertionError deep inside `to_edge`; the pass raises `SizeMinMaxUndecided` instead,
naming the op, its sizes and their bounds.
Writing the op as ExecuTorch's prim op instead is not an option: the retrace in
`to_edge` picks one operand by the example's sizes and keeps no guard, a program
wrong at every other size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from etfold.decisions import Declined, record_applied
from etfold.exir.passes.graph_walk import order_at_every_size, size_bounds
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import node_value

FOLD = "exir.size_min_max_decided_over_the_bounds"

SIZE_MIN_MAX = (torch.sym_min, torch.sym_max)


class SizeMinMaxUndecided(ValueError):
    """A min or max of sizes no rewrite decides, which ExecuTorch 1.5.1 cannot lower."""


@dataclass(frozen=True)
class DecidedMinMax:
    node: torch.fx.Node
    operand: torch.fx.Node  # the one it is at every allowed size
    order: str


def match_size_min_max(node: torch.fx.Node) -> DecidedMinMax | Declined | None:
    if node.op != "call_function" or node.target not in SIZE_MIN_MAX:
        return None
    first, second = node.args
    if not all(isinstance(operand, torch.fx.Node) for operand in (first, second)):
        return Declined("a number operand: kept")
    order = order_at_every_size(node_value(first), node_value(second))
    if order is None:
        return Declined(
            "which size is smaller changes within the export's bounds (or the bounds "
            "hold too many sizes to try): kept, and ExecuTorch 1.5.1's Edge verifier "
            f"refuses torch.{node.target.__name__}"
        )
    smaller, larger = (first, second) if order == "<=" else (second, first)
    return DecidedMinMax(node, smaller if node.target is torch.sym_min else larger, order)


def rewrite_as_operand(match: DecidedMinMax) -> None:
    node = match.node
    first, second = node.args
    detail = (
        f"torch.{node.target.__name__} is {match.operand.name} at every allowed size "
        f"({first.name} {match.order} {second.name})"
    )
    node.replace_all_uses_with(match.operand)
    node.graph.erase_node(node)
    record_applied(FOLD, node.name, detail)


def size_min_max_decided_over_the_bounds(program: ExportedProgram) -> ExportedProgram:
    """`program`, or a copy where each decidable size min / max is its operand; raises
    `SizeMinMaxUndecided` when one that is read is left."""
    rewritten = rewrite_matches_on_a_copy(program, match_size_min_max, rewrite_as_operand, FOLD)
    left = [n for n in rewritten.graph.nodes if n.target in SIZE_MIN_MAX and n.users]
    if left:
        raise SizeMinMaxUndecided(_undecided(left[0]))
    return rewritten


def _undecided(node: torch.fx.Node) -> str:
    sizes = []
    for operand in node.args:
        value = node_value(operand) if isinstance(operand, torch.fx.Node) else operand
        low, high = size_bounds(value)
        sizes.append(f"{value} (in {low}..{high})")
    return (
        f"{node.name} = torch.{node.target.__name__}({', '.join(sizes)}): which is "
        "smaller changes within the export's bounds, and ExecuTorch 1.5.1's Edge verifier "
        "refuses torch.sym_min / sym_max; bound the dims so one is always the smaller, "
        "or export the sizes static"
    )
