# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Select: which call_function nodes of a lifted program may fold. Nothing runs here.

A node is selected when every node it reads is a constant source
(`graph_walk.constant_sources`) or an earlier selected node, it is in the
allowlist when there is one, its target is not skipped, and its sources agree
on `custom` meta. Each node that is not selected for a reason a user can act on
gets one decline record.

Skipped targets. Impure, nondeterministic (RNG) and allocation ops never fold:
that would freeze a side effect, one random draw or uninitialised memory.
Beyond those, `custom_skip_targets=None` skips upstream's default set (Edge
`full` and the Edge quantization primitives), so in ATen dialect a dequantize of
a constant weight folds, the weight dequantized ahead of time, as upstream does.
A collection of targets replaces the default; `SkipFamilies` names targets by
family in every dialect (`FILLS_AND_QUANT_OPS`: etfold's stricter set).
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from executorch.exir import memory
from executorch.exir.passes.constant_prop_pass import (
    _DEFAULT_SKIP_TARGETS as UPSTREAM_DEFAULT_SKIP_TARGETS,
)
from torch.export import ExportedProgram

from etfold.decisions import Declined, record_declined
from etfold.exir.passes.constant_prop import FOLD
from etfold.exir.passes.graph_walk import (
    ConstantSource,
    constant_sources,
    op_namespace,
    op_qualified_name,
    underlying_op,
)

# Factory ops that only fill a tensor with one value: folding one stores the fill.
FILL_FACTORIES = frozenset(
    {
        "full",
        "full_like",
        "new_full",
        "ones",
        "ones_like",
        "new_ones",
        "zeros",
        "zeros_like",
        "new_zeros",
    }
)
# Their contents are undefined until written.
ALLOCATIONS = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
)
QUANT_NAMESPACES = frozenset({"quantized_decomposed", "torchao"})
# Higher-order ops whose subgraphs the pass does not enter.
CONTROL_FLOW_OPS = frozenset(
    getattr(torch.ops.higher_order, name)
    for name in ("cond", "while_loop", "scan", "map_impl")
    if hasattr(torch.ops.higher_order, name)
)
CONTROL_FLOW_WARNING = "constant_prop_pass does not constant propagate in control flow modules"

UNSET = object()  # "no source yet" in the custom-meta agreement


def _packet_name(target) -> str | None:
    op = underlying_op(target)
    return op.overloadpacket.__name__ if isinstance(op, torch._ops.OpOverload) else None


def is_impure(node: torch.fx.Node) -> bool:
    """Side effects (mutation, asserts, prints); randomness is `is_nondeterministic`."""
    return node.is_impure(impure_random=False)


def is_nondeterministic(node: torch.fx.Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(underlying_op(node.target), "tags", ())


def allocates_memory(node: torch.fx.Node) -> bool:
    return node.target is memory.alloc or _packet_name(node.target) in ALLOCATIONS


def is_fill_factory(node: torch.fx.Node) -> bool:
    """An op whose values do not depend on any input's data: `full`, `ones_like`, ...,
    `fill.Scalar`, and `scalar_tensor` of a literal (of a computed scalar it carries data)."""
    name = _packet_name(node.target)
    if name in FILL_FACTORIES or op_qualified_name(node.target) == "aten.fill.Scalar":
        return True
    return name == "scalar_tensor" and not node.all_input_nodes


def is_quant_primitive(node: torch.fx.Node) -> bool:
    return op_namespace(node.target) in QUANT_NAMESPACES


def has_control_flow(graph: torch.fx.Graph) -> bool:
    return any(node.target in CONTROL_FLOW_OPS for node in graph.nodes)


@dataclass(frozen=True)
class SkipFamilies:
    """Skip targets named by family, in every dialect, each with its own reason."""

    fills: bool = True
    quantization: bool = True

    def decline(self, node: torch.fx.Node) -> Declined | None:
        if self.fills and is_fill_factory(node):
            return Declined("factory op that only fills a tensor")
        if self.quantization and is_quant_primitive(node):
            return Declined("quantization primitive")
        return None


FILLS_AND_QUANT_OPS = SkipFamilies()

SkipTargets = Collection | SkipFamilies | None


def skip_decline(node: torch.fx.Node, skip: SkipTargets) -> Declined | None:
    """Why `node`'s target must not fold, or None."""
    if is_impure(node):
        return Declined("impure op")
    if is_nondeterministic(node):
        return Declined("nondeterministic op (nondeterministic_seeded)")
    if allocates_memory(node):
        return Declined("memory allocation op")
    if isinstance(skip, SkipFamilies):
        return skip.decline(node)
    if skip is None:
        if node.target in UPSTREAM_DEFAULT_SKIP_TARGETS:
            return Declined(f"{op_qualified_name(node.target)} is a default skip target")
        return None
    if node.target in skip or underlying_op(node.target) in skip:
        return Declined("in custom_skip_targets")
    return None


def agreed_custom(node: torch.fx.Node, custom: Mapping[torch.fx.Node, Any]):
    """The `custom` meta all of `node`'s producers agree on (UNSET: none has any), or a Declined."""
    agreed = UNSET
    for producer in node.all_input_nodes:
        value = custom[producer]
        if value is UNSET:
            continue
        if agreed is UNSET:
            agreed = value
        elif value != agreed:
            return Declined(f"sources disagree on custom meta ({agreed!r} vs {value!r})")
    return agreed


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
    sources, excluded = constant_sources(ep, fold_buffers=fold_buffers)
    allowed = allowlist(ep.graph, nodes_to_fold)
    custom: dict[torch.fx.Node, Any] = {n: n.meta.get("custom") or None for n in sources}
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
        verdict = skip_decline(node, skip)
        if verdict is None:
            verdict = agreed_custom(node, custom)
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
