# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""What a backend wants entered around each etfold lowering call.

`etfold.exir.to_edge_transform_and_lower` enters every registered scope around
upstream's lowering, so a backend can give back, when the call returns or
raises, whatever it installed for it. Backends register here; the entry point
never imports a backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

LoweringScope = Callable[[], AbstractContextManager]

_scopes: list[LoweringScope] = []


def register_lowering_scope(scope: LoweringScope) -> None:
    """Enter `scope()` around every later lowering call (registering twice is one registration)."""
    if scope not in _scopes:
        _scopes.append(scope)


def unregister_lowering_scope(scope: LoweringScope) -> None:
    if scope in _scopes:
        _scopes.remove(scope)


def registered_lowering_scopes() -> tuple[LoweringScope, ...]:
    return tuple(_scopes)


@contextlib.contextmanager
def lowering_scopes():
    """Every registered scope, entered in registration order, left in reverse."""
    with contextlib.ExitStack() as stack:
        for scope in tuple(_scopes):
            stack.enter_context(scope())
        yield
