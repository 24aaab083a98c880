# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Fold an inference batch norm into the linear before it, on a rank-2 activation.

Given:   y = batch_norm(linear(x, W, b), g, beta, mean, var, eps)     linear(x): [N, C]
Result:  y = linear(x, W * s[:, None], (b - mean) * s + beta)         s = g / sqrt(var + eps)

Why: Arm's float pipeline fuses a batch norm only into a conv. Any other batch
norm it rewrites as a depthwise conv, which on a rank-2 input fails to lower
(`FuseBatchNorm2dPass`: a 4-D weight for a 2-D input). A `BatchNorm1d` after a
`Linear` is that case. On the integer path torchao's `prepare_pt2e` already folds
it the same way before calibration.

Where it runs: on etfold's copy of the ATen program before decomposition
(`register_arm_folds()`). The fused values come from torch's own
`fuse_linear_bn_weights`; they are new constants named from their sources.

Declines: a linear something else also reads; constants the program writes; a
non-float32 layer (the fused values would be rounded twice).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from etfold.decisions import Declined, record_applied
from etfold.exir.passes.graph_walk import (
    ConstantSource,
    fresh_constant_name,
    known_placeholder,
    state_facts,
    underlying_op,
)
from etfold.exir.passes.node_rewrite_driver import matches_in
from etfold.exir.passes.node_shapes import node_value
from etfold.exir.passes.own_constants_before_batch_norm_fusion_pass import (
    is_inference_batch_norm,
)
from etfold.exir.program.working_copy import copy_for_rewrite

FOLD = "arm.batch_norm_into_linear"

_LINEAR = torch.ops.aten.linear.default
_EPS = {
    torch.ops.aten.batch_norm.default: 7,
    torch.ops.aten.native_batch_norm.default: 7,
    torch.ops.aten._native_batch_norm_legit_no_training.default: 6,
}


@dataclass(frozen=True)
class LinearBatchNorm:
    linear: Node
    batch_norm: Node
    weight: ConstantSource
    bias: ConstantSource | None
    mean: ConstantSource
    var: ConstantSource
    gamma: ConstantSource | None
    beta: ConstantSource | None
    eps: float


def _constant(program, facts, value) -> ConstantSource | Declined | None:
    if value is None:
        return None
    if not isinstance(value, Node) or value.op != "placeholder":
        return Declined("an operand is computed at runtime")
    known = known_placeholder(program, value, facts=facts)
    if known is None:
        return Declined(f"`{value.name}` is a runtime input")
    return known


def match_linear_batch_norm(program: ExportedProgram, facts, node: Node):
    if not is_inference_batch_norm(node):
        return None
    linear = node.args[0]
    if not isinstance(linear, Node) or underlying_op(linear.target) != _LINEAR:
        return None
    value = node_value(linear)
    if value is None or value.dim() != 2:
        return None  # batch norm over another axis than the linear's features
    if any(u.target is operator.getitem and u.args[1] != 0 for u in node.users):
        return Declined("the batch norm's statistics outputs are read")
    if len(linear.users) > 1:
        return Declined(f"`{linear.name}`'s output is read by more than the batch norm")
    if value.dtype != torch.float32:
        return Declined(f"a {value.dtype} linear: the fused values would be rounded twice")
    weight, bias = linear.args[1], linear.args[2] if len(linear.args) > 2 else None
    operands = [weight, bias, *node.args[3:5], *node.args[1:3]]
    sources = [_constant(program, facts, v) for v in operands]
    if any(isinstance(s, Declined) for s in sources) or sources[0] is None or None in sources[2:4]:
        return next((s for s in sources if isinstance(s, Declined)), Declined("no weight"))
    return LinearBatchNorm(linear, node, *sources, eps=node.args[_EPS[underlying_op(node.target)]])


def fold_batch_norms_into_linears(program: ExportedProgram) -> ExportedProgram:
    """`program` itself when nothing folds; else a copy with every match folded."""
    if not _matches(program, record=True):
        return program
    program = copy_for_rewrite(program)
    for match in _matches(program, record=False):
        record_applied(FOLD, match.batch_norm.name, _fold(program, match))
    program.graph_module.recompile()
    return program


def _matches(program: ExportedProgram, record: bool) -> list[LinearBatchNorm]:
    facts = state_facts(program)
    return matches_in(
        program,
        lambda node: match_linear_batch_norm(program, facts, node),
        FOLD if record else None,
    )


def _tensor(source: ConstantSource | None):
    return None if source is None else source.tensor.detach()


def _fold(program: ExportedProgram, match: LinearBatchNorm) -> str:
    from torch.nn.utils.fusion import fuse_linear_bn_weights

    weight, bias = fuse_linear_bn_weights(
        *map(_tensor, (match.weight, match.bias, match.mean, match.var)),
        match.eps,
        *map(_tensor, (match.gamma, match.beta)),
    )
    suffix = f"_bn_{match.batch_norm.name}"
    new_weight = _new_constant(program, match.weight, suffix, weight)
    new_bias = _new_constant(program, match.bias or match.weight, suffix + "_bias", bias)
    match.linear.args = (match.linear.args[0], new_weight, new_bias)
    for user in list(match.batch_norm.users):
        if user.target is operator.getitem:
            user.replace_all_uses_with(match.linear)
            program.graph.erase_node(user)
    match.batch_norm.replace_all_uses_with(match.linear)
    program.graph.erase_node(match.batch_norm)
    _delete_if_unread(program, match)
    return f"`{match.batch_norm.name}` folded into `{match.linear.name}`'s weight and bias"


def _new_constant(program, like: ConstantSource, suffix: str, data: torch.Tensor) -> Node:
    from executorch.backends.transforms.utils import create_constant_placeholder

    name = fresh_constant_name(program.graph_module, program, like.fqn + suffix, data)
    with program.graph.inserting_after(like.node):
        return create_constant_placeholder(
            program, program.graph, name, like.kind, data.detach(), like.persistent
        )


def _delete_if_unread(program: ExportedProgram, match: LinearBatchNorm) -> None:
    from executorch.backends.transforms.utils import delete_constant_placeholder

    sources = (match.weight, match.bias, match.mean, match.var, match.gamma, match.beta)
    for source in {s.node for s in sources if s is not None}:
        if not source.users:
            delete_constant_placeholder(program, source)
