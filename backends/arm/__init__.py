"""etfold's Arm folds. Nothing is registered until `register_arm_folds()` is called."""

from etfold.backends.arm.registration import (
    arm_folds_registered,
    register_arm_folds,
    unregister_arm_folds,
)

__all__ = ["arm_folds_registered", "register_arm_folds", "unregister_arm_folds"]
