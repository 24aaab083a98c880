"""How etfold's Arm passes enter ArmPassManager pipelines.

Nothing is registered on import: `register_arm_folds()` installs, and
`unregister_arm_folds()` restores upstream exactly. The scalar-mul issue fills
in the installation; the DyT issue adds its passes to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_registered = False


def register_arm_folds() -> None:
    global _registered
    _registered = True


def unregister_arm_folds() -> None:
    global _registered
    _registered = False


def arm_folds_registered_now() -> bool:
    return _registered


@contextlib.contextmanager
def arm_folds_registered() -> Iterator[None]:
    """Register for the block; leave registration as it was afterwards."""
    was_registered = _registered
    register_arm_folds()
    try:
        yield
    finally:
        if not was_registered:
            unregister_arm_folds()
