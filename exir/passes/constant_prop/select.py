# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Select: which call_function nodes of a lifted program may fold. Nothing runs here.

A node is selected when every node it reads is a constant source
(`verdicts.constant_sources`) or an earlier selected node, it is in the
allowlist when there is one, `verdicts.op_verdict` lets it run at export time,
and its inputs agree on `custom` meta (`verdicts.agreed_custom`). Each node that
is not selected for a reason a user can act on gets one decline record.

Skipped targets (`op_verdict`): `custom_skip_targets=None` skips upstream's
default set (Edge `full` and the Edge quantization primitives), so in ATen
dialect a dequantize of a constant weight folds, the weight dequantized ahead of
time, as upstream does. A collection of targets replaces the default;
`SkipFamilies` names targets by family in every dialect (`FILLS_AND_QUANT_OPS`:
etfold's stricter set).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram

from etfold.decisions import Declined, record_declined
from etfold.exir.passes.constant_prop import FOLD
from etfold.exir.passes.constant_prop.verdicts import (
    SkipTargets,
    SourcePolicy,
    agreed_custom,
    constant_sources,
    op_verdict,
    source_custom,
)
from etfold.exir.passes.graph_walk import ConstantSource

# Higher-order ops whose subgraphs the pass does not enter.
CONTROL_FLOW_OPS = frozenset(
    getattr(torch.ops.higher_order, name)
    for name in ("cond", "while_loop", "scan", "map_impl")
    if hasattr(torch.ops.higher_order, name)
)
CONTROL_FLOW_WARNING = "constant_prop_pass does not constant propagate in control flow modules"


def has_control_flow(graph: torch.fx.Graph) -> bool:
    return any(node.target in CONTROL_FLOW_OPS for node in graph.nodes)


def allowlist(graph: torch.fx.Graph, nodes_to_fold) -> set[torch.fx.Node] | None:
    """The nodes `nodes_to_fold` names (nodes or node names); None: everything is allowed."""
    if nodes_to_fold is None:
        return None
    by_name = None
    allowed: set[torch.fx.Node] = set()
    for item in nodes_to_fold:
        if isinstance(item, str):
            by_name = by_name if by_name is not None else {n.name: n for n in graph.nodes}
            item = by_name.get(item)
        if isinstance(item, torch.fx.Node) and item.graph is graph:
            allowed.add(item)
    # a multi-output op folds with all its outputs
    for node in list(allowed):
        allowed.update(u for u in node.users if u.target is operator.getitem)
    return allowed


@dataclass(frozen=True)
class Selection:
    """The constant sources, and the nodes that may fold over them, in graph order."""

    sources: Mapping[torch.fx.Node, ConstantSource]
    nodes: tuple[torch.fx.Node, ...]
    custom: Mapping[torch.fx.Node, Any]  # agreed `custom` meta per source and selected node


def _record_read_of_excluded(node, excluded, constant, allowed) -> None:
    """A node kept from folding only by a constant the pass may not use says which one."""
    blocked = [p for p in node.all_input_nodes if p in excluded]
    if not blocked or (allowed is not None and node not in allowed):
        return
    if all(p in constant or p in excluded for p in node.all_input_nodes):
        record_declined(FOLD, node.name, f"reads {excluded[blocked[0]]}")


def select_folds(
    ep: ExportedProgram, skip: SkipTargets, *, nodes_to_fold=None, fold_buffers: bool = True
) -> Selection:
    sources, excluded = constant_sources(ep, SourcePolicy(fold_buffers=fold_buffers))
    allowed = allowlist(ep.graph, nodes_to_fold)
    custom: dict[torch.fx.Node, Any] = {n: source_custom(n) for n in sources}
    selected: list[torch.fx.Node] = []
    outside_allowlist = 0
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        if not all(p in custom for p in node.all_input_nodes):
            _record_read_of_excluded(node, excluded, custom, allowed)
            continue
        if allowed is not None and node not in allowed:
            outside_allowlist += 1
            continue
        verdict = op_verdict(node, skip)
        if verdict is None:
            verdict = agreed_custom(node.all_input_nodes, custom.__getitem__)
        if isinstance(verdict, Declined):
            record_declined(FOLD, node.name, verdict.reason)
            continue
        custom[node] = verdict
        selected.append(node)
    if outside_allowlist:
        record_declined(
            FOLD,
            "<program>",
            f"{outside_allowlist} constant-only node(s) outside nodes_to_fold stay ops",
        )
    return Selection(sources, tuple(selected), custom)
