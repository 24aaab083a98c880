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
        super().__init__(config_precisions=ConfigPrecisionType.DYNAMIC_QUANT, **kwargs)
