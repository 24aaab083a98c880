# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A commutative elementwise op takes its higher-rank operand first.

    y = mul(s, conv(x))        s rank 0 (a value computed at runtime), conv(x) rank 4
      -> y = mul(conv(x), s)

Stock Arm lowering of such a mul to TOSA FP gives wrong values (the reference
model's output is off by about the output's own size) when the lower-rank operand
comes first, and right ones with the operands the other way round. Swapping them
is exact: floating-point add and mul are commutative, bit for bit. Only float
tensors are touched; the quantized graph keeps upstream's order.
"""

from __future__ import annotations

from dataclasses import dataclass

from executorch.backends.arm._passes.arm_pass import ArmPass
from executorch.exir.dialects._ops import ops as exir_ops
from executorch.exir.pass_base import ExportPass, PassResult
from torch.fx import GraphModule, Node

from etfold.decisions import Declined
from etfold.exir.passes.node_rewrite_driver import rewrite_each_match
from etfold.exir.passes.node_shapes import node_value, rank_of

FOLD = "arm.higher_rank_operand_first"

COMMUTATIVE = frozenset({exir_ops.edge.aten.mul.Tensor, exir_ops.edge.aten.add.Tensor})


@dataclass(frozen=True)
class LowerRankFirst:
    node: Node


def match_lower_rank_first(node: Node) -> LowerRankFirst | Declined | None:
    if node.op != "call_function" or node.target not in COMMUTATIVE or len(node.args) != 2:
        return None
    if node.kwargs.get("alpha", 1) != 1:
        return None
    first, second = node.args
    ranks = rank_of(first), rank_of(second)
    if None in ranks or ranks[0] >= ranks[1]:
        return None
    values = [node_value(a) for a in (first, second)]
    if not all(v.dtype.is_floating_point for v in values):
        return None  # the integer graph is not this pass's: upstream's order stays
    if values[0].dtype != values[1].dtype:
        return Declined("operands of two float dtypes: swapping could change the promotion")
    return LowerRankFirst(node)


def put_higher_rank_first(match: LowerRankFirst) -> str:
    first, second = match.node.args
    match.node.args = (second, first)
    return f"operands swapped: rank {rank_of(second)} first, rank {rank_of(first)} second"


class HigherRankOperandFirstPass(ArmPass):
    """`mul(s, y)` -> `mul(y, s)` (and add) when s has the lower rank; see the module docstring."""

    _passes_required_after: set[type[ExportPass]] = set()

    def call(self, graph_module: GraphModule) -> PassResult:
        nodes = list(graph_module.graph.nodes)
        modified = rewrite_each_match(nodes, match_lower_rank_first, put_higher_rank_first, FOLD)
        if modified:
            graph_module.recompile()
        return PassResult(graph_module, modified)
