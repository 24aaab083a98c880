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
follows in the same lowering, this one partitions nothing, and the linears are
partitioned with their neighbours (not in bf16 programs, where it was measured to leave
linears outside). It still keeps its ops from decomposition and runs
its rewrites: the linears reach the general partitioner in the form this one keeps.
"""

from __future__ import annotations

from executorch.exir.backend.partitioner import PartitionResult
from torch.export import ExportedProgram

from etfold.backends.xnnpack.partition.bf16_delegation import bf16_applies
from etfold.backends.xnnpack.partition.dynamically_quantized import (
    XnnpackDynamicallyQuantizedPartitioner,
)
from etfold.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from etfold.decisions import record_applied, record_declined

FOLD = "xnnpack.deferred_linears"


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

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        if self.deferred_to is None:
            return super().partition(exported_program)
        if bf16_applies(exported_program, self._user_enable_bf16):
            # measured: the general partitioner's bf16 settings leave bf16 linears outside
            record_declined(
                FOLD, "program", "bf16 program: the general partitioner may not take every linear"
            )
            return super().partition(exported_program)
        record_applied(FOLD, "program", "the general partitioner takes the linears with the rest")
        return PartitionResult(tagged_exported_program=exported_program, partition_tags={})
