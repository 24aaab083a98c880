# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""XNNConvert: serialize `prims.convert_element_type` (fp32 <-> fp16/bf16) as an XNNPACK convert.

The node only exists inside delegates that etfold's partitioner marked (see
`RewriteDtypeCopiesAsConvertsPass`). Defining this class registers nothing:
`etfold.backends.xnnpack.install.install()` puts it in upstream's registry.
"""

from __future__ import annotations

import torch
from executorch.backends.xnnpack.operators.node_visitor import NodeVisitor
from executorch.backends.xnnpack.serialization.xnnpack_graph_schema import (
    XNNConvert,
    XNNGraph,
    XNode,
)
from executorch.backends.xnnpack.utils.utils import check_or_raise, get_input_node

from etfold.backends.xnnpack._passes.dtype_convert_match import CONVERT_TARGET, is_fp32_pair
from etfold.exir.passes.node_shapes import node_value


class XNNConvertVisitor(NodeVisitor):
    target = CONVERT_TARGET.__name__

    def define_node(
        self,
        node: torch.fx.Node,
        xnn_graph: XNNGraph,
        vals_to_ids: dict[torch.fx.Node, int],
        debug_handle: int,
    ) -> None:
        source = get_input_node(node, 0)
        check_or_raise(
            is_fp32_pair(node_value(source).dtype, node_value(node).dtype),
            f"XNNConvert takes fp32 <-> fp16/bf16 only, got {node_value(source).dtype} -> "
            f"{node_value(node).dtype} at {node.name}",
        )
        # the tensors' layout tags (NHWC or not) come from the node metadata
        self.define_nodes_tensor_inputs_outputs(node, xnn_graph, vals_to_ids)
        xnn_graph.xnodes.append(
            XNode(
                xnode_union=XNNConvert(
                    input_id=vals_to_ids[source],
                    output_id=vals_to_ids[node],
                    flags=0,
                ),
                debug_handle=debug_handle,
            )
        )
