# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""One lookup of torch's composite-implicit ops per decomposition, not one per namespace.

`ExportedProgram.run_decompositions` collects every functional
CompositeImplicitAutograd op of every `torch.ops` namespace. Torch's collector
first looks up, by name, every such op the dispatcher knows (so each gets its
`torch.ops` entry), and it does so again for each of the ~40 namespaces it then
walks: the same ~2,500 lookups forty times per call, three calls per lowering,
about a fifth of lowering a small model. Nothing registers ops between two
namespaces of one walk, so inside `one_composite_op_lookup_per_walk()` a walk
looks them up once, then walks the namespaces as torch does. The set collected
is torch's own; the scope undoes itself on exit. Where torch's internals are not
the ones this was written against, the scope changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

from etfold.exir.program.reentrant_patch import ReentrantPatch

_COLLECTOR = "_collect_all_valid_cia_ops"
_LOOKUP = "_materialize_cpp_cia_ops"
_DEFINED_IN = "torch._export.utils"
_BOUND_IN = ("torch._export.utils", "torch.export.exported_program", "torch.export.decomp_utils")

_saved: dict[tuple[str, str], object] = {}


def _modules_binding_the_collector():
    modules = []
    for name in _BOUND_IN:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if callable(getattr(module, _COLLECTOR, None)):
            modules.append(module)
    return modules


def _walk_with_one_lookup(collector, defining_module, lookup):
    @functools.wraps(collector)
    def walk():
        lookup()
        setattr(defining_module, _LOOKUP, _already_looked_up)
        try:
            return collector()
        finally:
            setattr(defining_module, _LOOKUP, lookup)

    return walk


def _already_looked_up() -> None:
    return None


def _install() -> None:
    defining = importlib.import_module(_DEFINED_IN)
    lookup = getattr(defining, _LOOKUP, None)
    collector = getattr(defining, _COLLECTOR, None)
    if not (callable(lookup) and callable(collector)):
        return
    walk = _walk_with_one_lookup(collector, defining, lookup)
    for module in _modules_binding_the_collector():
        if getattr(module, _COLLECTOR) is collector:
            _saved[(module.__name__, _COLLECTOR)] = collector
            setattr(module, _COLLECTOR, walk)


def _uninstall() -> None:
    for (module_name, attribute), original in _saved.items():
        setattr(importlib.import_module(module_name), attribute, original)
    _saved.clear()


_PATCH = ReentrantPatch(_install, _uninstall)


def one_composite_op_lookup_per_walk() -> contextlib.AbstractContextManager[None]:
    """While entered (re-entrantly, from any thread), torch's CIA walk looks ops up once."""
    return _PATCH.scope()
