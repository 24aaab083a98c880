# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.


"""Operand promotion before the XNNPACK weight fold.

    add(a: f32, m: bf16 constant)  ->  add(a, to_f32(m))

Edge lowering inserts the same convert later, where it runs on every call; made
explicit here, the convert is constant-only work the weight fold computes once.
A widening float convert is exact.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram

from etfold.backends.xnnpack.partition.weight_fold_seeds import constant_only_nodes
from etfold.exir.passes.graph_walk import insert_to_copy
from etfold.exir.passes.node_shapes import node_value
from etfold.exir.program.working_copy import copy_for_rewrite

aten = torch.ops.aten

_PROMOTING_OPS = frozenset(
    {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.where.self}
)


def _promotions(program: ExportedProgram) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(op, constant operand) pairs where the operand is implicitly widened to the op's dtype."""
    constant = constant_only_nodes(program)
    found = []
    for node in program.graph.nodes:
        result = node_value(node)
        if node.op != "call_function" or node.target not in _PROMOTING_OPS:
            continue
        if not isinstance(result, torch.Tensor) or not result.dtype.is_floating_point:
            continue
        for operand in node.all_input_nodes:
            value = node_value(operand)
            if operand not in constant or not isinstance(value, torch.Tensor):
                continue
            if not value.dtype.is_floating_point or value.dtype == result.dtype:
                continue
            if torch.promote_types(value.dtype, result.dtype) != result.dtype:
                continue
            found.append((node, operand))
    return found


def promote_constant_operands(program: ExportedProgram) -> ExportedProgram:
    """Make a constant operand's implicit float promotion an explicit, foldable convert.

        add(a: f32, m: bf16 constant)  ->  add(a, to_f32(m))

    Edge lowering inserts the same convert later, where it runs on every call;
    a widening float convert is exact. The same program back when there is none,
    else a rewritten copy.
    """
    if not _promotions(program):
        return program
    program = copy_for_rewrite(program)
    for node, operand in _promotions(program):
        dtype = node_value(node).dtype
        with program.graph.inserting_before(node):
            widened = insert_to_copy(program.graph, operand, dtype=dtype)
        node.replace_input_with(operand, widened)
    program.graph_module.recompile()
    return program
