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
looks them up once, then walks the namespaces as torch does, asking the
dispatcher once for the ops with a composite kernel rather than once per op
(~7,000) and judging preservability only for those. The set collected is
torch's own; the scope undoes itself on exit. Where torch's internals are not
the ones this was written against, the scope changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import torch

from etfold.exir.program.reentrant_patch import ReentrantPatch

_COLLECTOR = "_collect_all_valid_cia_ops"
_LOOKUP = "_materialize_cpp_cia_ops"
_JUDGE = "_is_preservable_cia_op"
_COMPOSITE = "CompositeImplicitAutograd"
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


def _walk_with_one_lookup(collector, defining_module, lookup, judge):
    @functools.wraps(collector)
    def walk():
        lookup()
        registered = frozenset(torch._C._dispatch_get_registrations_for_dispatch_key(_COMPOSITE))
        setattr(defining_module, _LOOKUP, _already_looked_up)
        setattr(defining_module, _JUDGE, _composite_first(registered, defining_module))
        try:
            return collector()
        finally:
            setattr(defining_module, _JUDGE, judge)
            setattr(defining_module, _LOOKUP, lookup)

    return walk


def _composite_first(registered: frozenset[str], defining_module):
    """Torch's "preservable composite op" judgement, asking the cheap half first.

    An op has a composite kernel in C++ exactly when the dispatcher lists it among
    the key's registrations (one call per walk instead of one per op); only those
    and ops with a Python composite kernel are judged preservable, by torch's check
    as the module holds it now. Both halves are side-effect free, so their order is
    free and the judgement is torch's.
    """
    key = getattr(torch._C.DispatchKey, _COMPOSITE)

    def is_preservable_cia_op(op) -> bool:
        composite = op.name() in registered or (bool(op.py_kernels) and key in op.py_kernels)
        return composite and defining_module._check_valid_to_preserve(op)

    return is_preservable_cia_op


def _already_looked_up() -> None:
    return None


def _install() -> None:
    defining = importlib.import_module(_DEFINED_IN)
    lookup = getattr(defining, _LOOKUP, None)
    collector = getattr(defining, _COLLECTOR, None)
    judge = getattr(defining, _JUDGE, None)
    if not (callable(lookup) and callable(collector) and callable(judge)):
        return
    walk = _walk_with_one_lookup(collector, defining, lookup, judge)
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
