# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Graph modules a lowering builds write their Python code when it is first read.

A `GraphModule` generates and compiles Python source for its graph when it is
built and at every `recompile()`. A lowering builds hundreds (each `ExportPass`
and its pass manager, each retrace, each `ExportedProgram`) and the next step
reads only the graph: a tenth to a sixth of a lowering goes to source nobody
runs. Inside `code_on_first_use_for_graph_modules()` the plain graph modules
those builders make (`LOWERING_BUILDERS`) are torch's own `_LazyGraphModule`,
which generates the same code from the same graph on the first call, `.code`
read or pickle; its `recompile()` still refreshes the pytree specs (`_in_spec`,
`_out_spec`) that torch and torchao read without running the module, so they
are never stale. Every other graph module is built as torch builds it: one
whose `forward` signature is read (dynamo's, a quantizer's, the user's) must
have its code, since a lazy `forward` takes `*args`. A deep copy keeps its
source's class, as torch's own lazy modules do. The scope
undoes itself on exit; where torch's internals are not the ones this was written
against, it changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys

from torch.fx import GraphModule
from torch.fx.graph import _PyTreeCodeGen

from etfold.exir.program.reentrant_patch import ReentrantPatch

# (module, qualified name) of each function whose plain graph modules are built lazily;
# torch's `_make_graph_module` is looked through to the function that called it.
LOWERING_BUILDERS = (
    ("executorch.exir.pass_base", "_ExportPassBase.__init__"),
    ("executorch.exir.pass_base", "_ExportPassBase.call_submodule"),
    ("torch.export.exported_program", "_create_graph_module_for_export"),
    ("torch.fx.experimental.proxy_tensor", "dispatch_trace"),
)
_LOOKED_THROUGH = ("torch.fx._lazy_graph_module", "_make_graph_module")

_saved: list = []
_builders: set = set()


@functools.cache
def _lazy_class():
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:
        return None

    class CodeOnFirstUse(_LazyGraphModule):
        """Torch's lazy graph module whose pytree specs follow every recompile."""

        def recompile(self) -> None:
            codegen = self._graph._codegen
            if isinstance(codegen, _PyTreeCodeGen):
                self._in_spec = codegen.pytree_info.in_spec
                self._out_spec = codegen.pytree_info.out_spec
            type(self).forward = type(self)._lazy_forward

    return CodeOnFirstUse


def _code_of(module: str, qualified_name: str):
    target = importlib.import_module(module)
    for name in qualified_name.split("."):
        target = getattr(target, name, None)
    return getattr(target, "__code__", None)


def _lazy_when_a_lowering_builds_it(new, lazy, looked_through):
    def __new__(cls, *args, **kwargs):
        if cls is GraphModule:
            caller = sys._getframe(1)
            if caller.f_code is looked_through:
                caller = caller.f_back
            if caller.f_code in _builders:
                cls = lazy
        return new(cls, *args, **kwargs)

    return staticmethod(__new__)


def _install() -> None:
    new = GraphModule.__dict__.get("__new__")
    lazy = _lazy_class() if isinstance(new, staticmethod) else None
    if lazy is None or not hasattr(lazy, "_needs_recompile"):
        return
    _builders.update(filter(None, (_code_of(*builder) for builder in LOWERING_BUILDERS)))
    _saved.append(new)
    looked_through = _code_of(*_LOOKED_THROUGH)
    GraphModule.__new__ = _lazy_when_a_lowering_builds_it(new.__func__, lazy, looked_through)


def _uninstall() -> None:
    if _saved:
        GraphModule.__new__ = _saved.pop()
    _builders.clear()


_PATCH = ReentrantPatch(_install, _uninstall)


def code_on_first_use_for_graph_modules() -> contextlib.AbstractContextManager[None]:
    """While entered, plain graph modules a lowering builds generate their code on first use."""
    return _PATCH.scope()
