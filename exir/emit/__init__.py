# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""etfold's checks at emission time."""

from etfold.exir.emit.external_constants import (
    ExternalConstantCollisionError,
    check_external_constant_names,
)

__all__ = ["ExternalConstantCollisionError", "check_external_constant_names"]
