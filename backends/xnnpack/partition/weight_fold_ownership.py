# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Folded constants belong to the delegate that reads them.

    delegate{ add(x, C) }( C )        C a constant the weight fold or constant_prop_pass created
      -> delegate{ add(x, C) }()      C tagged like its readers: XNNPACK stores it as static data

Upstream's configs put a constant into a partition only as a GEMM's weight or
bias (and a few ops' parameters). A folded constant that another delegated op
reads (the first LSTM step's `h0 @ W_hh.T + b_hh`, read by an add; a zero cell
state, read by a mul) would otherwise be handed to the delegate as a runtime
input on every call. It joins its readers' partition when they all lie in one;
read by two partitions, or also by an op outside every partition, it stays an
input (one delegate cannot own what another also reads), and the reason is recorded.

Runs on the partitioner's result, after every node is tagged; it only adds tags.
"""

from __future__ import annotations

import torch
from executorch.exir.backend.partitioner import PartitionResult
from torch.export import ExportedProgram

from etfold.decisions import Declined, record_applied, record_declined
from etfold.exir.passes.constant_prop.name import is_folded_target
from etfold.exir.passes.graph_walk import STATE_KINDS

FOLD = "xnnpack.own_folded_constants"
_TAG = "delegation_tag"


def folded_constants(program: ExportedProgram) -> list[torch.fx.Node]:
    """Placeholders of constants constant propagation created (never a mutated buffer)."""
    signature = program.graph_signature
    mutated = set(signature.buffers_to_mutate.values())
    targets = {
        spec.arg.name: spec.target
        for spec in signature.input_specs
        if spec.kind in STATE_KINDS and spec.target not in mutated
    }
    return [
        node
        for node in program.graph.find_nodes(op="placeholder")
        if node.name in targets and is_folded_target(targets[node.name])
    ]


def owning_tag(constant: torch.fx.Node) -> str | Declined | None:
    """The one partition every reader lies in; Declined when there is none; None when no
    reader is delegated (the constant never reaches a delegate) or it is owned already."""
    if _TAG in constant.meta:
        return None
    tags = {reader.meta.get(_TAG) for reader in constant.users}
    if tags <= {None}:
        return None
    outside = sorted(r.name for r in constant.users if _TAG not in r.meta)
    if outside:
        return Declined(
            f"also read outside every delegate (by {', '.join(outside)}): "
            "stays a runtime input of the delegate that reads it"
        )
    if len(tags) > 1:
        return Declined(
            f"read by {len(tags)} delegates ({', '.join(sorted(tags))}): "
            "no one delegate can own it, it stays a runtime input of each"
        )
    (tag,) = tags
    return tag


def own_folded_constants(result: PartitionResult) -> PartitionResult:
    """Tag each folded constant with the one partition all its readers lie in."""
    for constant in folded_constants(result.tagged_exported_program):
        tag = owning_tag(constant)
        if isinstance(tag, Declined):
            record_declined(FOLD, constant.name, tag.reason)
        elif tag is not None:
            constant.meta[_TAG] = tag
            record_applied(FOLD, constant.name, f"owned by delegate {tag} as static data")
    return result
