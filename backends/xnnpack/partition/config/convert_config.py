# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Partitioner configs that accept fp32 <-> fp16/bf16 converts of activations.

`_to_dim_order_copy` (default dim-order edge programs) keeps upstream's rule for
same-dtype copies and adds float converts; `_to_copy` (programs lowered with
`EdgeCompileConfig(_skip_dim_order=True)`) takes float converts only, since
upstream delegates no `_to_copy`. Each declined convert is reported through
upstream's `why` and recorded as an etfold decision.
"""

from __future__ import annotations

import logging

import torch
from executorch.backends.xnnpack.partition.config.generic_node_configs import (
    GenericNodePartitionerConfig,
    ToDimOrderCopyConfig,
)
from executorch.backends.xnnpack.partition.config.xnnpack_config import ConfigPrecisionType
from executorch.exir.backend.utils import WhyNoPartition
from torch.export import ExportedProgram

from etfold.backends.xnnpack._passes.dtype_convert_match import (
    FOLD,
    changes_dtype,
    has_tensor_meta,
    match_dtype_convert,
    reads_user_input,
)
from etfold.decisions import Declined, record_declined
from etfold.exir.passes.node_shapes import node_value

why = WhyNoPartition(logger=logging.getLogger(__name__))


def fp32_precision_enabled(config: GenericNodePartitionerConfig) -> bool:
    return ConfigPrecisionType.FP32 in config.enabled_precision_types


def bf16_allowed(config: GenericNodePartitionerConfig, node: torch.fx.Node) -> bool:
    dtypes = {node_value(node).dtype, node_value(node.args[0]).dtype}
    return config.enable_bf16 or torch.bfloat16 not in dtypes


def accept_dtype_convert(
    config: GenericNodePartitionerConfig, node: torch.fx.Node, program: ExportedProgram
) -> None | Declined:
    """None when `node` is a float convert of an activation this config may delegate."""
    match = match_dtype_convert(node)
    if isinstance(match, Declined):
        return match
    if not fp32_precision_enabled(config):
        return Declined("FP32 precision is not enabled on this partitioner")
    if not bf16_allowed(config, node):
        return Declined("a bf16 convert needs XnnpackPartitioner(enable_bf16=True)")
    if not reads_user_input(node, program):
        return Declined(
            "converts a constant that no fold reached (the weight fold declined it, or "
            "to_edge lifted it as a scalar after the folds ran): never delegated"
        )
    if not config.check_common_constraints(node, program):
        return Declined("fails XNNPACK's common constraints (dtype, empty or unbacked shape)")
    return None


def _decline(node: torch.fx.Node, declined: Declined) -> bool:
    why(node, reason=declined.reason)
    record_declined(FOLD, node.name, declined.reason)
    return False


def is_dtype_changing_copy(node: torch.fx.Node) -> bool:
    return has_tensor_meta(node) and changes_dtype(node)


class DtypeConvertingToDimOrderCopyConfig(ToDimOrderCopyConfig):
    """`_to_dim_order_copy`: upstream's layout copies, plus fp32 <-> fp16/bf16 converts."""

    def check_constraints(self, node: torch.fx.Node, ep: ExportedProgram) -> bool:
        if not is_dtype_changing_copy(node):
            return super().check_constraints(node, ep)
        declined = accept_dtype_convert(self, node, ep)
        return True if declined is None else _decline(node, declined)


class DtypeConvertingToCopyConfig(GenericNodePartitionerConfig):
    """`_to_copy`: fp32 <-> fp16/bf16 converts only; layout-only copies stay as upstream has them."""

    target_name = "_to_copy.default"

    def supported_precision_types(self) -> list[ConfigPrecisionType]:
        return [ConfigPrecisionType.FP32]

    def check_constraints(self, node: torch.fx.Node, ep: ExportedProgram) -> bool:
        if not is_dtype_changing_copy(node):
            why(node, reason="layout-only _to_copy is not delegated (as upstream)")
            return False
        declined = accept_dtype_convert(self, node, ep)
        return True if declined is None else _decline(node, declined)


def with_dtype_convert_configs(configs: list) -> list:
    """`configs` with upstream's `_to_dim_order_copy` config swapped for etfold's.

    The `_to_copy` config joins only when copies are partitioned at all.
    """
    swapped = [
        DtypeConvertingToDimOrderCopyConfig if config is ToDimOrderCopyConfig else config
        for config in configs
    ]
    if (
        DtypeConvertingToDimOrderCopyConfig in swapped
        and DtypeConvertingToCopyConfig not in swapped
    ):
        swapped.append(DtypeConvertingToCopyConfig)
    return swapped
