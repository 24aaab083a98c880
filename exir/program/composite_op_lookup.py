# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""One lookup of torch's composite-implicit ops per walk, not one per namespace.

`ExportedProgram.run_decompositions` collects every functional
CompositeImplicitAutograd op of every `torch.ops` namespace
(`_collect_all_valid_cia_ops`). For each of the ~40 namespaces it walks, torch
first calls `_materialize_cpp_cia_ops`, which looks up by name every such op
the dispatcher knows (~2,500) so each gets its `torch.ops` entry: the same
lookups forty times per walk, several walks per lowering. Nothing registers ops
between two namespaces of one walk, so inside `one_composite_op_lookup_per_walk()`
torch's walk runs as it is, with torch's lookup called once at its start and
skipped for the rest of that walk (in this context; a walk in another thread
looks up as torch does). The set collected is torch's own.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib

from etfold.exir.program.reentrant_patch import PatchUnavailable, ReentrantPatch, Replacement

_COLLECTOR = "_collect_all_valid_cia_ops"
_LOOKUP = "_materialize_cpp_cia_ops"
_DEFINED_IN = "torch._export.utils"
_BOUND_IN = ("torch._export.utils", "torch.export.exported_program", "torch.export.decomp_utils")

# this context is inside a walk whose lookup has run
_looked_up: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "etfold_cia_looked_up", default=False
)


def _walk_with_one_lookup(collector):
    @functools.wraps(collector)
    def walk():
        if _looked_up.get():
            return collector()
        getattr(importlib.import_module(_DEFINED_IN), _LOOKUP)()
        token = _looked_up.set(True)
        try:
            return collector()
        finally:
            _looked_up.reset(token)

    return walk


def _lookup_unless_done(lookup):
    @functools.wraps(lookup)
    def lookup_once():
        if not _looked_up.get():
            lookup()

    return lookup_once


def _replacements() -> list[Replacement]:
    defining = importlib.import_module(_DEFINED_IN)
    collector = vars(defining).get(_COLLECTOR)
    if not callable(collector):
        raise PatchUnavailable(f"{_DEFINED_IN}.{_COLLECTOR} is gone")
    replacements = [Replacement(defining, _LOOKUP, _lookup_unless_done)]
    for name in _BOUND_IN:
        module = importlib.import_module(name)
        if vars(module).get(_COLLECTOR) is collector:
            replacements.append(Replacement(module, _COLLECTOR, _walk_with_one_lookup))
    return replacements


PATCH = ReentrantPatch("composite_op_lookup", _replacements)


def one_composite_op_lookup_per_walk() -> contextlib.AbstractContextManager[None]:
    """While entered, torch's CIA walk looks ops up once per walk, in this context."""
    return PATCH.scope()
