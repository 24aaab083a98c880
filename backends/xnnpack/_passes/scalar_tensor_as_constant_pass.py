# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A `scalar_tensor` of a number as the constant it makes.

Given:   t = scalar_tensor(c, dtype=d)        c a number known when lowering
Result:  t = C                                C = scalar_tensor(c, dtype=d), computed once
                                              when lowering: a lifted 0-d constant

The op reads nothing but its arguments, so its value is the same on every call:
computing it once, with the same op, gives the same bits.

Why: torch's decomposition of a `where` with number operands, and attention's
conversion of a boolean mask into the float mask it adds (`where(m, 0, -inf)`),
write two `scalar_tensor`s: with the mask a runtime input, nothing folds them, and
they run outside the delegates on every call.

Declines: a number the program computes (from a symbolic size), a tensor not
plain on the CPU (another device, layout or pinning requested). Runs on the ATen
program, before decomposition; a program holding an attention is decomposed with
the lowering's own table first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from etfold.backends.xnnpack._passes.decomposed_first import decomposed_for
from etfold.decisions import Declined, record_applied
from etfold.exir.passes.graph_walk import add_lifted_constant
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy

FOLD = "xnnpack.scalar_tensor_as_constant"

aten = torch.ops.aten
# measured on torch 2.13: their decomposition writes scalar_tensor (a boolean mask's where)
WRITE_SCALAR_TENSORS = frozenset(
    {
        aten.scaled_dot_product_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
)
_PLAIN = {"layout": (None, torch.strided), "pin_memory": (None, False)}


@dataclass(frozen=True)
class ScalarTensorAsConstant:
    node: Node
    value: torch.Tensor


def plain_arguments(node: Node) -> Declined | None:
    """A number, and no device, layout or pinning but the default's."""
    (number,) = node.args
    if not isinstance(number, (bool, int, float)):
        return Declined(f"reads `{number}`, a number known only when the program runs")
    for name, plain in _PLAIN.items():
        if node.kwargs.get(name) not in plain:
            return Declined(f"{name}={node.kwargs[name]!r}: not a plain CPU tensor")
    device = node.kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return Declined(f"device {device}: not a CPU tensor")
    return None


def match_scalar_tensor(node: Node) -> ScalarTensorAsConstant | Declined | None:
    if node.op != "call_function" or node.target is not aten.scalar_tensor.default:
        return None
    if (declined := plain_arguments(node)) is not None:
        return declined
    value = aten.scalar_tensor.default(node.args[0], dtype=node.kwargs.get("dtype"))
    return ScalarTensorAsConstant(node, value)


def rewrite_scalar_tensor(match: ScalarTensorAsConstant, program: ExportedProgram) -> None:
    node = match.node
    constant = add_lifted_constant(program, f"{node.name}_value", match.value)
    node.replace_all_uses_with(constant)
    node.graph.erase_node(node)
    record_applied(FOLD, node.name, f"{match.value.item()!r} ({match.value.dtype}) as a constant")


def _writes_scalar_tensors(node: Node) -> bool:
    return node.target in WRITE_SCALAR_TENSORS


def scalar_tensors_as_constants(
    program: ExportedProgram, decomposition_table: Mapping | None
) -> ExportedProgram:
    """`program`, or a rewritten copy (decomposed first where an attention writes them)
    where each `scalar_tensor` is a constant."""
    candidate = decomposed_for(program, decomposition_table, _writes_scalar_tensors)
    copies: list[ExportedProgram] = []
    rewritten = rewrite_matches_on_a_copy(
        candidate,
        match_scalar_tensor,
        lambda found: rewrite_scalar_tensor(found, copies[0]),
        FOLD,
        copies.append,
    )
    return program if rewritten is candidate else rewritten
