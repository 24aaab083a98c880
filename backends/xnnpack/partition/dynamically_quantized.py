# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""etfold's XnnpackDynamicallyQuantizedPartitioner: upstream's, built on etfold's partitioner.

Upstream builds its dynamically quantized partitioner as its XnnpackPartitioner with
`config_precisions` pinned to DYNAMIC_QUANT; this is etfold's XnnpackPartitioner pinned
the same way, so it takes the same keyword arguments (etfold's `fold_weights` and
`delegate_dtype_converts` among them) and refuses `config_precisions` as upstream does.
ExecuTorch's LLM export asks for it first, to take the dynamically quantized linears.

It keeps only the configs that can take a dynamically quantized op (upstream's others
are disabled by the pinned precision and never match). etfold's exact rewrites run for
the ops whose config is present, so with the disabled ones present they would rewrite
norms, splits and expands that no delegate of this partitioner takes, left outside in
their rewritten form. For the same reason it delegates no dtype converts by default:
its convert configs are fp32 ones. The weight fold, for the linears it takes, stays on.

Upstream's GEMM configs take fp32 linears here too, each as its own delegate. A layer
norm's row means, which the general partitioner's rewrite writes as GEMVs, are left to
the general partitioner, inside the norm's delegate: taken here, each norm would cut
its delegate in three.
"""

from __future__ import annotations

import torch
from executorch.backends.xnnpack.partition.config.xnnpack_config import ConfigPrecisionType
from executorch.backends.xnnpack.utils.utils import get_param_tensor, is_param_node
from executorch.exir.dialects._ops import ops as exir_ops
from torch.export import ExportedProgram

from etfold.backends.xnnpack._passes.layer_norm_as_delegated_ops_pass import is_row_mean_column
from etfold.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner


class XnnpackDynamicallyQuantizedPartitioner(XnnpackPartitioner):
    def __init__(self, **kwargs):
        if "config_precisions" in kwargs:
            raise ValueError(
                "XnnpackDynamicallyQuantizedPartitioner always partitions dynamically quantized"
                " ops (DYNAMIC_QUANT); it takes no config_precisions argument"
            )
        kwargs.setdefault("delegate_dtype_converts", False)
        super().__init__(config_precisions=ConfigPrecisionType.DYNAMIC_QUANT, **kwargs)
        self.target_partitioner_configs = {
            target: config
            for target, config in self.target_partitioner_configs.items()
            if config.enabled_precision_types
        }

    def get_matched_nodes_from_configs(self, ep: ExportedProgram):
        groups = super().get_matched_nodes_from_configs(ep)
        return [group for group in groups if not any(_row_mean(ep, n) for n in group)]


def _row_mean(ep: ExportedProgram, node: torch.fx.Node) -> bool:
    """`node` is a linear whose weight is a row-mean column: a norm's statistic."""
    if node.target is not exir_ops.edge.aten.linear.default or len(node.args) < 2:
        return False
    weight = node.args[1]
    if not isinstance(weight, torch.fx.Node) or not is_param_node(ep, weight):
        return False
    tensor = get_param_tensor(ep, weight)
    return isinstance(tensor, torch.Tensor) and is_row_mean_column(tensor)
