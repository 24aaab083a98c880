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
more calls per lowering. The closure reads only the operator and the key it was
made for, and does its checks and its registration when called, so inside
`one_py_kernel_closure_per_key()` torch's closure for an (operator, key) pair is
made once and reused, by every later scope too: a memo around torch's own `py_impl`. What every
registration does is unchanged.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

from torch._ops import OperatorBase

from etfold.exir.program.reentrant_patch import ReentrantPatch, Replacement

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


# The closures outlive the scope: each reads only its (operator, key), and the pairs are
# bounded by the ops torch knows (~6,000 per lowering, the same ones every time).
PATCH = ReentrantPatch(
    "py_kernel_closures", lambda: [Replacement(OperatorBase, "py_impl", _closure_per_key)]
)


def one_py_kernel_closure_per_key() -> contextlib.AbstractContextManager[None]:
    """While entered, `py_impl(key)` reuses its closure per op and key, in this context."""
    return PATCH.scope()
