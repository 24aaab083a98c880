# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Upstream's slice visitor, with each symbolic size written as XNNPACK's inferred 0.

Upstream serializes a slice's sizes from the output's upper-bound shape; on a
dynamic shape the runtime would then cut every call to the bound. XNNPACK reads a
size of 0 at offset 0 as the whole dim at the size the runtime resizes to (see
`dynamic_slices`), so the node upstream wrote gets 0 where the output's size is
symbolic. A static slice is serialized exactly as upstream does.
"""

from __future__ import annotations

import torch
from executorch.backends.xnnpack import operators  # noqa: F401  (registers upstream's visitors)
from executorch.backends.xnnpack.operators import node_visitor
from executorch.backends.xnnpack.utils.utils import PERM_NCHW_TO_NHWC

from etfold.exir.passes.graph_walk import symbolic_axes
from etfold.exir.passes.node_shapes import node_value

SLICE_TARGET = "aten.slice_copy.Tensor"
# upstream's module binds the name to its registering decorator's result (None): the
# class is the registry's entry, read before etfold swaps anything in
UpstreamSliceVisitor = node_visitor._node_visitor_dict[SLICE_TARGET]


class DynamicSliceVisitor(UpstreamSliceVisitor):
    def define_node(self, node: torch.fx.Node, xnn_graph, vals_to_ids, debug_handle) -> None:
        super().define_node(node, xnn_graph, vals_to_ids, debug_handle)
        symbolic = set(symbolic_axes(node_value(node)))
        if not symbolic:
            return
        written = xnn_graph.xnodes[-1].xnode_union
        axes = list(range(len(written.sizes)))
        if "XNN_NHWC_NODE" in node.meta:
            axes = [PERM_NCHW_TO_NHWC[i] for i in axes]
        written.sizes = [
            0 if axis in symbolic else size for axis, size in zip(axes, written.sizes, strict=True)
        ]
