# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""etfold's XNNPACK folds. Import `XnnpackPartitioner` from here."""

from etfold.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

__all__ = ["XnnpackPartitioner"]
