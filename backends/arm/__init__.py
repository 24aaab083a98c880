# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""etfold's Arm folds. Nothing is registered until `register_arm_folds()` is called."""

from etfold.backends.arm._passes import (
    FoldScalarMulIntoConvPass,
    is_carried_quant_state,
    mark_carried_quant_state,
    mark_carried_state_outputs,
)
from etfold.backends.arm._passes.fold_dyt_affine_into_conv_float_pass import (
    FoldDyTAffineIntoConvFloatPass,
)
from etfold.backends.arm._passes.fold_dyt_affine_into_conv_pass import FoldDyTAffineIntoConvPass
from etfold.backends.arm._passes.fold_dyt_alpha_into_lut_pass import FoldDyTAlphaIntoLUTPass
from etfold.backends.arm._passes.fold_scalar_mul_into_conv_pass import (
    power_of_two_scales_fold_into_carried_state,
)
from etfold.backends.arm.registration import (
    ARM_PASS_INSERTIONS,
    ArmPassInsertion,
    ArmRegistrationError,
    are_arm_folds_registered,
    arm_folds_registered,
    register_arm_folds,
    unregister_arm_folds,
)

__all__ = [
    "ARM_PASS_INSERTIONS",
    "ArmPassInsertion",
    "ArmRegistrationError",
    "FoldDyTAffineIntoConvFloatPass",
    "FoldDyTAffineIntoConvPass",
    "FoldDyTAlphaIntoLUTPass",
    "FoldScalarMulIntoConvPass",
    "arm_folds_registered",
    "are_arm_folds_registered",
    "is_carried_quant_state",
    "mark_carried_quant_state",
    "mark_carried_state_outputs",
    "power_of_two_scales_fold_into_carried_state",
    "register_arm_folds",
    "unregister_arm_folds",
]
