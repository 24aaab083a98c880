# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A copy XNNPACK drops must not leave its delegate beside the value it copies.

    delegate{ y = f(...); c = clone(y) }   y and c both read outside
      -> XNNPACK's preprocess drops the clone: the delegate returns y twice

XNNPACK's preprocess refuses that (stock fails to lower it: a dynamic wav2vec2's
feature projection is returned beside its contiguous copy). Such a clone stays
outside, a portable copy, recorded, and the partitions are drawn again. A clone
of a value the program itself returns is known before partitioning and is kept
out from the start (`clones_of_returned_values`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
from executorch.exir.dialects._ops import ops as exir_ops
from torch.export import ExportedProgram

from etfold.decisions import record_declined

FOLD = "xnnpack.repeated_output"
CLONES = frozenset(
    {
        exir_ops.edge.aten.clone.default,
        exir_ops.edge.dim_order_ops._clone_dim_order.default,
    }
)


def _is_clone(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in CLONES


def clones_of_returned_values(ep: ExportedProgram) -> list[torch.fx.Node]:
    """Clones of a value the program also returns (a buffer's update returned as a user
    output too), each recorded: inside a delegate the delegate would return it twice."""
    returned = {v for v in ep.graph.output_node().args[0] if isinstance(v, torch.fx.Node)}
    clones = [n for n in ep.graph.nodes if _is_clone(n) and n.args[0] in returned]
    for clone in clones:
        record_declined(
            FOLD,
            clone.name,
            f"copies `{clone.args[0].name}`, which the program also returns; inside a delegate"
            " the copy would be dropped and the delegate return one value twice",
        )
    return clones


def _leaves(node: torch.fx.Node, nodes: Collection[torch.fx.Node]) -> bool:
    return any(user not in nodes for user in node.users)


def clones_beside_their_source(partitions: Iterable[Collection[torch.fx.Node]]) -> list:
    """Clones read outside their partition whose source, in the partition, is read
    outside it too; each recorded: once XNNPACK drops the clone, the delegate would
    return one value twice."""
    found = []
    for nodes in partitions:
        for clone in filter(_is_clone, nodes):
            source = clone.args[0]
            if source in nodes and _leaves(source, nodes) and _leaves(clone, nodes):
                record_declined(
                    FOLD,
                    clone.name,
                    f"copies `{source.name}`, which leaves the delegate too; inside, the copy "
                    "would be dropped and the delegate return one value twice",
                )
                found.append(clone)
    return found
