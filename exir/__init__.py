# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""etfold's exir additions."""

from etfold.exir.emit.external_constants import ExternalConstantCollisionError
from etfold.exir.passes.constant_prop_pass import constant_prop_pass
from etfold.exir.program.declared_bounds import DeclaredBoundNarrowed, declared_bounds_kept
from etfold.exir.program.lower import to_edge_transform_and_lower

__all__ = [
    "DeclaredBoundNarrowed",
    "ExternalConstantCollisionError",
    "constant_prop_pass",
    "declared_bounds_kept",
    "to_edge_transform_and_lower",
]
