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
from etfold.backends.xnnpack.pattern_graphs_on_demand import PATCH as _PATTERNS_ON_DEMAND
from etfold.exir.program.speedups import register_speedup

register_speedup(_PATTERNS_ON_DEMAND)

__all__ = ["XnnpackDynamicallyQuantizedPartitioner", "XnnpackPartitioner"]
