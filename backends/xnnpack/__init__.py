# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""etfold's XNNPACK folds. Import `XnnpackPartitioner` from here."""

from etfold.backends.xnnpack.partition.dynamically_quantized import (
    XnnpackDynamicallyQuantizedPartitioner,
)
from etfold.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from etfold.backends.xnnpack.pattern_graphs_on_demand import patterns_on_demand
from etfold.exir.program.lowering_scopes import register_lowering_scope

register_lowering_scope(patterns_on_demand)

__all__ = ["XnnpackDynamicallyQuantizedPartitioner", "XnnpackPartitioner"]
