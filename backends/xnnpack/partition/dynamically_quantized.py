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
"""

from __future__ import annotations

from executorch.backends.xnnpack.partition.config.xnnpack_config import ConfigPrecisionType

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
