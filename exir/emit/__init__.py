"""etfold's checks at emission time."""

from etfold.exir.emit.external_constants import (
    ExternalConstantCollisionError,
    check_external_constant_names,
)

__all__ = ["ExternalConstantCollisionError", "check_external_constant_names"]
