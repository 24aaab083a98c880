# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Torch's check "may this composite op be preserved", its fixed part answered once per op.

Every walk over torch's composite-implicit ops (one per `run_decompositions`,
more when a decomposition table is read) asks of each of ~600 ops whether it
may be preserved: not tagged maybe-aliasing, not a metadata function, a schema
that neither mutates nor aliases, and a kernel registered for its name. All
but the last are fixed by the op's schema and tags, which never change for an
`OpOverload`; inside `fixed_preservability_checked_once()` they are computed
once per op, and the kernel lookup, which registrations can change, is asked
each time as torch asks it. Same answers; the scope undoes itself on exit.
Where torch's internals are not the ones this was written against, the scope
changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable

import torch
from torch._ops import OpOverload

from etfold.exir.program.reentrant_patch import ReentrantPatch

_DEFINED_IN = "torch._export.utils"
_CHECK = "_check_valid_to_preserve"

_fixed_verdicts: dict[OpOverload, bool] = {}


def _fixed_part_allows(op: OpOverload) -> bool:
    """What torch's check decides before it looks for a registered kernel."""
    from torch._decomp import _should_decompose_because_unsafe_op
    from torch._subclasses.functional_tensor import FunctionalTensor

    if _should_decompose_because_unsafe_op(op) or op in FunctionalTensor.metadata_fns:
        return False
    schema = op._schema
    aliases = any(argument.alias_info is not None for argument in schema.arguments)
    return not (aliases or schema.is_mutable)


def _checked_once_per_op(torchs_check: Callable) -> Callable:
    @functools.wraps(torchs_check)
    def check(op) -> bool:
        if type(op) is not OpOverload:
            return torchs_check(op)
        try:
            allowed = _fixed_verdicts[op]
        except KeyError:
            allowed = _fixed_verdicts[op] = _fixed_part_allows(op)
        return allowed and torch._C._dispatch_has_kernel(op.name())

    return check


_saved: list[Callable] = []


def _install() -> None:
    defining = importlib.import_module(_DEFINED_IN)
    torchs_check = getattr(defining, _CHECK, None)
    if callable(torchs_check) and hasattr(torch._C, "_dispatch_has_kernel"):
        _saved.append(torchs_check)
        setattr(defining, _CHECK, _checked_once_per_op(torchs_check))


def _uninstall() -> None:
    if _saved:
        setattr(importlib.import_module(_DEFINED_IN), _CHECK, _saved.pop())
    _fixed_verdicts.clear()


_PATCH = ReentrantPatch(_install, _uninstall)


def torchs_check() -> Callable:
    """Torch's own check, also while the scope is entered (what the scope is compared against)."""
    return _saved[0] if _saved else getattr(importlib.import_module(_DEFINED_IN), _CHECK)


def fixed_preservability_checked_once() -> contextlib.AbstractContextManager[None]:
    """While entered (re-entrantly, from any thread), an op's schema and tags are judged once."""
    return _PATCH.scope()
