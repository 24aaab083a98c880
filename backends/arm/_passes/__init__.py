# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""etfold's Arm passes."""

from etfold.backends.arm._passes.carried_state import (
    carried_region,
    is_carried_quant_state,
    mark_carried_quant_state,
    mark_carried_state_outputs,
)
from etfold.backends.arm._passes.fold_scalar_mul_into_conv_pass import FoldScalarMulIntoConvPass

__all__ = [
    "FoldScalarMulIntoConvPass",
    "carried_region",
    "is_carried_quant_state",
    "mark_carried_quant_state",
    "mark_carried_state_outputs",
]
