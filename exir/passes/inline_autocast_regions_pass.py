# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Inline autocast and grad-mode regions, so folds see the ops inside them.

    wrap_with_autocast(device, dtype, enabled, cache, body, *args)
      -> body(*args) with autocast's casts explicit:
         linear(x, W, b) -> linear(to(x, dtype), to(W, dtype), to(b, dtype))   (and so on
         for every op autocast casts on `device`, nested regions included)
    wrap_with_set_grad_enabled(mode, body, *args)
      -> body(*args)                                  (grad mode changes no value in inference)

`torch.export` keeps such a region as one higher-order call on a submodule, so a
pass that walks the top-level graph finds no GEMM inside it and the region's
casts are only made explicit at decomposition, after every fold ran. The
rewrite is the retrace decomposition itself runs, with an empty table
(`run_decompositions({})`: composite ops kept, nothing decomposed), done
earlier; a program without such a region comes back untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from etfold.decisions import Declined, record_applied, record_declined

FOLD = "exir.inline_autocast_regions"

INLINABLE_REGIONS = (
    torch.ops.higher_order.wrap_with_autocast,
    torch.ops.higher_order.wrap_with_set_grad_enabled,
)


@dataclass(frozen=True)
class InlinableRegions:
    nodes: tuple[torch.fx.Node, ...]


def _regions(graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [
        n
        for n in graph_module.graph.nodes
        if n.op == "call_function" and n.target in INLINABLE_REGIONS
    ]


def is_training_program(program: ExportedProgram) -> bool:
    return program.graph_signature.backward_signature is not None


def match_inlinable_regions(program: ExportedProgram) -> InlinableRegions | Declined | None:
    """None when the program holds no region (nothing worth recording)."""
    regions = _regions(program.graph_module)
    if not regions:
        return None
    if is_training_program(program):
        return Declined("training program (backward signature): regions stay for autograd")
    return InlinableRegions(tuple(regions))


def _describe(node: torch.fx.Node) -> str:
    if node.target is torch.ops.higher_order.wrap_with_autocast:
        device, dtype, enabled = node.args[:3]
        return f"autocast({device}, {dtype}, enabled={enabled})"
    return f"set_grad_enabled({node.args[0]})"


def inline_regions(program: ExportedProgram, match: InlinableRegions) -> ExportedProgram:
    """Rewrite: a new program with every region inlined (the input is left as it was)."""
    kinds = ", ".join(sorted({_describe(n) for n in match.nodes}))
    names = [n.name for n in match.nodes]
    inlined = program.run_decompositions({})
    record_applied(FOLD, ", ".join(names), f"{len(names)} regions inlined: {kinds}")
    return inlined


def inline_autocast_regions(program: ExportedProgram) -> ExportedProgram:
    """The same object back unless a region is inlined."""
    match = match_inlinable_regions(program)
    if match is None:
        return program
    if isinstance(match, Declined):
        record_declined(FOLD, "program", match.reason)
        return program
    return inline_regions(program, match)
