# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A partitioner config taking slices on dynamic shapes, where XNNPACK resizes them.

Upstream's `SliceCopyConfig` refuses any slice whose input or output has a
symbolic size, so on a dynamic export every split piece and every rotary half
stays outside. `DynamicSliceConfig` keeps upstream's verdict for static slices
and takes a dynamic one when `slice_resizes_at_runtime` says so (each symbolic
dim kept whole, the sliced dim static). Such a slice is serialized by
`DynamicSliceVisitor` (its symbolic sizes as XNNPACK's inferred 0), so the
partitions holding one carry `DYNAMIC_SLICES_SPEC`: etfold's preprocess wrapper
installs that visitor for them.
"""

from __future__ import annotations

import logging

import torch
from executorch.backends.xnnpack.partition.config.generic_node_configs import SliceCopyConfig
from executorch.backends.xnnpack.utils.quant_utils import is_dequant
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.backend.partitioner import PartitionResult
from executorch.exir.backend.utils import WhyNoPartition
from torch.export import ExportedProgram

from etfold.backends.xnnpack._passes.dynamic_slices import dynamic_slice_declined, is_dynamic
from etfold.backends.xnnpack.partition.marked_partitions import tags_holding, with_spec_on
from etfold.decisions import record_declined
from etfold.exir.passes.graph_walk import op_qualified_name
from etfold.exir.passes.node_shapes import node_value

FOLD = "xnnpack.dynamic_slice"
DYNAMIC_SLICES_SPEC = CompileSpec("etfold.dynamic_slices", b"1")
why = WhyNoPartition(logger=logging.getLogger(__name__))


def is_dynamic_slice(node: torch.fx.Node) -> bool:
    """A `slice_copy` whose input or output has a symbolic size."""
    if node.op != "call_function" or op_qualified_name(node.target) != "aten.slice_copy.Tensor":
        return False
    return is_dynamic(node_value(node)) or is_dynamic(node_value(node.args[0]))


class DynamicSliceConfig(SliceCopyConfig):
    """Upstream's slice config, plus slices XNNPACK resizes at runtime."""

    def check_constraints(self, node: torch.fx.Node, ep: ExportedProgram) -> bool:
        if not is_dynamic_slice(node):
            return super().check_constraints(node, ep)
        declined = dynamic_slice_declined(node)
        reason = declined.reason if declined is not None else None
        if reason is None and is_dequant(node.args[0]):
            reason = "a quantized dynamic slice: its quantization is not checked here"
        if reason is None and not self.check_common_constraints(node, ep):
            reason = "fails XNNPACK's common constraints (dtype, unbacked shape)"
        if reason is None:
            return True
        why(node, reason=reason)
        record_declined(FOLD, node.name, reason)
        return False


def with_dynamic_slice_config(configs: list) -> list:
    """`configs` with upstream's slice config swapped for etfold's."""
    return [DynamicSliceConfig if config is SliceCopyConfig else config for config in configs]


def mark_dynamic_slice_partitions(result: PartitionResult) -> PartitionResult:
    """The partitions holding a dynamic slice carry `DYNAMIC_SLICES_SPEC`."""

    def holds_slice(nodes):
        return any(is_dynamic_slice(n) for n in nodes)

    return with_spec_on(result, tags_holding(result, holds_slice), DYNAMIC_SLICES_SPEC)


def has_dynamic_slices(compile_specs) -> bool:
    return any(spec.key == DYNAMIC_SLICES_SPEC.key for spec in compile_specs)
