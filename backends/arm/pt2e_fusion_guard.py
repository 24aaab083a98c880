# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""torchao's `prepare_pt2e` fuses conv/linear + batch norm into layers with constants
of their own.

`prepare_pt2e` fuses batch norms before any quantizer hook runs (the quantizer's
`transform_for_annotation` comes after), and writes each fused weight into the
weight's own attribute: a weight two layers share ends with one layer's fused
values, and the second layer's batch norm is dropped. While etfold's Arm folds
are registered, the two fusion functions `prepare_pt2e` calls are replaced in its
module (`registration` replaces and restores them with the other upstream
attributes): each first gives every layer it will fuse constants no other node
reads (`own_constants_in_graph_module`), then runs torchao's own function.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

from etfold.backends.arm.upstream_arm import ArmRegistrationError

PREPARE_MODULE = "torchao.quantization.pt2e.quantize_pt2e"
FUSIONS = ("_fuse_conv_bn_", "_fuse_linear_bn_")


def pt2e_prepare_module():
    """torchao's module whose `prepare_pt2e` calls the fusions, checked to still have them."""
    module = importlib.import_module(PREPARE_MODULE)
    missing = [name for name in FUSIONS if not callable(getattr(module, name, None))]
    if missing:
        raise ArmRegistrationError(f"{PREPARE_MODULE} no longer has {missing}")
    return module


def fusion_with_own_constants(fusion: Callable) -> Callable:
    """torchao's `fusion`, run after every layer it fuses got constants of its own."""

    @functools.wraps(fusion)
    def fuse_with_own_constants(graph_module, *args, **kwargs):
        from etfold.exir.passes.own_constants_before_batch_norm_fusion_pass import (
            own_constants_in_graph_module,
        )

        own_constants_in_graph_module(graph_module)
        return fusion(graph_module, *args, **kwargs)

    fuse_with_own_constants.__etfold_wrapped__ = fusion  # type: ignore[attr-defined]
    return fuse_with_own_constants
