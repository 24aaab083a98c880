# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""One registration closure per (operator, dispatch key), not one per registration.

`OperatorBase.py_impl(key)` builds a fresh `inner(fn)` closure on every call,
and building it evaluates its typing annotations (two `Callable[...]` aliases).
Each `run_decompositions` registers, then restores, Python kernels for every
composite-implicit op under several keys: ~6,000 closures per call, three or
more calls per lowering, a third of lowering a small model. The closure reads
only the operator and the key it was made for, and does its checks and its
registration when called, so inside `one_py_kernel_closure_per_key()` the
closure made for an (operator, key) pair is made once and reused. What every
registration does is unchanged; the scope undoes itself on exit. Where torch's
internals are not the ones this was written against, the scope changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

from torch._ops import OperatorBase

from etfold.exir.program.reentrant_patch import ReentrantPatch

_ATTRIBUTE = "py_impl"
_saved: list[Callable] = []
_closures: dict[tuple[object, object], Callable] = {}


def _closure_per_key(make_closure: Callable) -> Callable:
    @functools.wraps(make_closure)
    def py_impl(self, k):
        try:
            return _closures[(self, k)]
        except KeyError:
            closure = _closures[(self, k)] = make_closure(self, k)
            return closure
        except TypeError:  # an unhashable key: torch's own path
            return make_closure(self, k)

    return py_impl


def _install() -> None:
    make_closure = OperatorBase.__dict__.get(_ATTRIBUTE)
    if callable(make_closure):
        _saved.append(make_closure)
        setattr(OperatorBase, _ATTRIBUTE, _closure_per_key(make_closure))


def _uninstall() -> None:
    if _saved:
        setattr(OperatorBase, _ATTRIBUTE, _saved.pop())
    _closures.clear()


_PATCH = ReentrantPatch(_install, _uninstall)


def one_py_kernel_closure_per_key() -> contextlib.AbstractContextManager[None]:
    """While entered (re-entrantly, from any thread), `py_impl(key)` reuses its closure per op and key."""
    return _PATCH.scope()
