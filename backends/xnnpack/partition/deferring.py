# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A dynamically quantized partitioner that can hand its work to a later general one.

A pipeline that lowers with the dynamically quantized partitioner and then with the
general one (ExecuTorch's LLM export does) gets each linear as a delegate of its own:
the second partitioner cannot join its partitions to the first one's delegates. The
general partitioner enables the dynamically quantized configs as well, so when it
follows in the same lowering, this one takes nothing (no kept ops, no rewrites, no
partitions) and the linears are partitioned with their neighbours.
"""

from __future__ import annotations

import logging

from executorch.exir.backend.partitioner import PartitionResult
from torch.export import ExportedProgram

from etfold.backends.xnnpack.partition.dynamically_quantized import (
    XnnpackDynamicallyQuantizedPartitioner,
)
from etfold.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

logger = logging.getLogger(__name__)


class DeferringDynamicallyQuantizedPartitioner(XnnpackDynamicallyQuantizedPartitioner):
    """etfold's XnnpackDynamicallyQuantizedPartitioner until `defer_to(general)`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.deferred_to: XnnpackPartitioner | None = None

    def defer_to(self, general: XnnpackPartitioner) -> None:
        """`general`, which runs later in the same lowering, takes this one's work."""
        if not isinstance(general, XnnpackPartitioner) or general.per_op_mode:
            raise ValueError("only a whole-graph etfold XnnpackPartitioner can take it over")
        self.deferred_to = general

    def ops_to_not_decompose(self, ep: ExportedProgram):
        if self.deferred_to is None:
            return super().ops_to_not_decompose(ep)
        return [], None

    def transform_for_pre_decomposition(self, exported_program: ExportedProgram):
        if self.deferred_to is None:
            return super().transform_for_pre_decomposition(exported_program)
        return exported_program

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        if self.deferred_to is None:
            return super().partition(exported_program)
        logger.info(
            "dynamically quantized partitioner: deferred to the general partitioner that"
            " follows, which takes the linears with their neighbours"
        )
        return PartitionResult(tagged_exported_program=exported_program, partition_tags={})
