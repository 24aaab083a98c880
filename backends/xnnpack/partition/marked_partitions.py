# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A compile spec added to some partitions of a partition result."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.backend.partitioner import DelegationSpec, PartitionResult


def tags_holding(result: PartitionResult, holds: Callable[[Iterable[torch.fx.Node]], bool]):
    """The delegation tags whose member nodes satisfy `holds`."""
    members: dict[str, list[torch.fx.Node]] = {}
    for node in result.tagged_exported_program.graph.nodes:
        if "delegation_tag" in node.meta:
            members.setdefault(node.meta["delegation_tag"], []).append(node)
    return {tag for tag, nodes in members.items() if holds(nodes)}


def with_spec_on(result: PartitionResult, tags: set, spec: CompileSpec) -> PartitionResult:
    """`result` with `spec` appended to the compile specs of the partitions in `tags`."""
    if not tags:
        return result
    partition_tags = {
        tag: DelegationSpec(given.backend_id, [*given.compile_specs, spec])
        if tag in tags
        else given
        for tag, given in result.partition_tags.items()
    }
    return PartitionResult(result.tagged_exported_program, partition_tags)
