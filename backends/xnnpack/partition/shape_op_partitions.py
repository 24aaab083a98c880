# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Where the squeezes and unsqueezes written as views ended up, and no reshape-only delegate.

    delegate{ view(x) }      every op in it a rewritten squeeze/unsqueeze
      -> view(x)             on portable kernels: the same copy, without a delegate call

A partition holding nothing but such views adds a delegate for no XNNPACK work
(upstream would not have delegated the squeeze or unsqueeze at all), so its tag
is dropped. Each rewritten node's outcome is recorded: inside a delegate, or
outside with the reason.
"""

from __future__ import annotations

import torch
from executorch.exir.backend.partitioner import PartitionResult

from etfold.backends.xnnpack._passes.shape_ops_as_views_pass import FOLD, SHAPE_OP_MARK
from etfold.decisions import record_applied, record_declined

_TAG = "delegation_tag"


def rewritten_from(node: torch.fx.Node) -> str | None:
    """The squeeze or unsqueeze this node was written from, if it was."""
    return node.meta.get("custom", {}).get(SHAPE_OP_MARK)


def views_only_tags(nodes: list[torch.fx.Node]) -> set[str]:
    """Partitions whose every op is a rewritten squeeze or unsqueeze."""
    members: dict[str, list[torch.fx.Node]] = {}
    for node in nodes:
        if node.op == "call_function" and _TAG in node.meta:
            members.setdefault(node.meta[_TAG], []).append(node)
    return {tag for tag, group in members.items() if all(map(rewritten_from, group))}


def _outcome(node: torch.fx.Node, original: str, dropped: bool) -> None:
    if _TAG in node.meta:
        record_applied(FOLD, node.name, f"{original} runs as an XNNPACK reshape")
    elif dropped:
        record_declined(
            FOLD, node.name, f"{original}: no delegated op beside it; a reshape-only delegate"
        )
    else:
        record_declined(FOLD, node.name, f"{original}: XNNPACK's view_copy config declined it")


def settle_shape_op_views(result: PartitionResult) -> PartitionResult:
    """Drop reshape-only partitions; record where each rewritten squeeze/unsqueeze went."""
    nodes = list(result.tagged_exported_program.graph.nodes)
    dropped_tags = views_only_tags(nodes)
    for node in nodes:
        dropped = node.meta.get(_TAG) in dropped_tags
        if dropped:
            del node.meta[_TAG]
        original = rewritten_from(node)
        if original is not None:
            _outcome(node, original, dropped)
    if not dropped_tags:
        return result
    kept = {tag: spec for tag, spec in result.partition_tags.items() if tag not in dropped_tags}
    return PartitionResult(result.tagged_exported_program, kept)
