# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Graph modules a lowering builds write their Python code once, when the lowering ends.

A `GraphModule` generates and compiles Python source for its graph when it is
built and at every `recompile()`. A lowering builds hundreds (each `ExportPass`
and its pass manager, each retrace, each `ExportedProgram`) and the next step
reads only the graph: a tenth to a sixth of a lowering goes to source nobody
runs. Inside `code_on_first_use_for_graph_modules()` the plain graph modules
those builders make (`LOWERING_BUILDERS`), and their deep copies, are torch's
`_LazyGraphModule`, which writes the same code from the same graph when first
called or read; its `recompile()` also refreshes the pytree specs (`_in_spec`,
`_out_spec`) that torch and torchao read without running the module. A graph
module whose `forward` signature is read (dynamo's, a quantizer's, the user's)
is built as torch builds it. A builder is matched by its code object, so each is
checked first to exist and to still build a graph module itself
(`check_builds_graph_modules`); otherwise the patch is unavailable and the
speed-ups are off, with a warning.

Nothing lazy leaves the scope: when this context's outermost scope exits, every
lazy module it built that is still alive becomes a plain `GraphModule` of
torch's own (a fresh per-instance class, as `GraphModule.__new__` makes) and is
recompiled by torch's `GraphModule.recompile`. What the user gets back has only
torch's classes, and `recompile()` returns torch's `PythonCode`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import sys
import weakref
from collections.abc import Iterator

from torch.fx import GraphModule
from torch.fx.graph import _PyTreeCodeGen

from etfold.exir.program.reentrant_patch import (
    GATE_CODE,
    PatchUnavailable,
    ReentrantPatch,
    Replacement,
)

# (module, qualified name) of each function whose plain graph modules are built lazily;
# torch's `_make_graph_module` is looked through to the function that called it. (make_fx's
# `dispatch_trace` is not one: its modules, the retraces of `run_decompositions`, were
# matched by the code of the decorator wrapping it, never, and are built as torch builds them.)
LOWERING_BUILDERS = (
    ("executorch.exir.pass_base", "_ExportPassBase.__init__"),
    ("executorch.exir.pass_base", "_ExportPassBase.call_submodule"),
    ("torch.export.exported_program", "_create_graph_module_for_export"),
)
_LOOKED_THROUGH = ("torch.fx._lazy_graph_module", "_make_graph_module")

# the lazy modules this context's outermost scope built, made torch's when it exits
_built_here: contextvars.ContextVar[list[weakref.ref] | None] = contextvars.ContextVar(
    "etfold_lazy_graph_modules", default=None
)


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


def _function_of(module: str, qualified_name: str):
    target = importlib.import_module(module)
    for name in qualified_name.split("."):
        target = getattr(target, name, None)
    return target


def _code_of(module: str, qualified_name: str):
    """The code a caller's frame runs: the function's own, looked through its decorators."""
    function = _function_of(module, qualified_name)
    code = getattr(inspect.unwrap(function), "__code__", None) if callable(function) else None
    if code is None:
        raise PatchUnavailable(f"{module}.{qualified_name} is gone")
    return code


# the names a builder calls a graph module into being by
_GRAPH_MODULE_MAKERS = frozenset({"GraphModule", "_make_graph_module"})


def check_builds_graph_modules(function: object, where: str) -> None:
    """Raise `PatchUnavailable` unless `function`, looked through its decorators, still
    builds a graph module itself: a builder that no longer does would be matched for
    nothing, and the speed-up would be gone without a word."""
    code = getattr(inspect.unwrap(function), "__code__", None) if callable(function) else None
    if code is None or not _GRAPH_MODULE_MAKERS & set(code.co_names):
        raise PatchUnavailable(f"{where} no longer builds a graph module itself")


def _builder_code(module: str, qualified_name: str):
    code = _code_of(module, qualified_name)
    check_builds_graph_modules(_function_of(module, qualified_name), f"{module}.{qualified_name}")
    return code


def _lazy_when_a_lowering_builds_it(lazy, builders: frozenset, looked_through):
    def make(new):
        def __new__(cls, *args, **kwargs):
            if cls is GraphModule:
                caller = sys._getframe(1)
                if caller.f_code is GATE_CODE:
                    caller = caller.f_back
                if caller.f_code is looked_through:
                    caller = caller.f_back
                if caller.f_code in builders:
                    cls = lazy
            module = new(cls, *args, **kwargs)
            built = _built_here.get()
            if built is not None and isinstance(module, lazy):
                built.append(weakref.ref(module))
            return module

        return __new__

    return make


def _replacements() -> list[Replacement]:
    lazy = _lazy_class()
    if lazy is None or not hasattr(lazy, "_needs_recompile"):
        raise PatchUnavailable("torch.fx._lazy_graph_module._LazyGraphModule is gone")
    if not isinstance(vars(GraphModule).get("__new__"), staticmethod):
        raise PatchUnavailable("torch.fx.GraphModule.__new__ is no longer a staticmethod")
    builders = frozenset(_builder_code(*builder) for builder in LOWERING_BUILDERS)
    make = _lazy_when_a_lowering_builds_it(lazy, builders, _code_of(*_LOOKED_THROUGH))
    return [Replacement(GraphModule, "__new__", make)]


PATCH = ReentrantPatch("lazy_graph_modules", _replacements)


def as_torchs_graph_module(module: GraphModule) -> None:
    """Give a lazy graph module torch's per-instance `GraphModule` class and its code."""
    torchs_new = PATCH.original(GraphModule, "__new__").__func__
    module.__class__ = type(torchs_new(GraphModule))
    module.recompile()


def _made_torchs(built: list[weakref.ref]) -> None:
    lazy = _lazy_class()
    for reference in built:
        module = reference()
        if module is not None and isinstance(module, lazy):
            as_torchs_graph_module(module)


@contextlib.contextmanager
def code_on_first_use_for_graph_modules() -> Iterator[None]:
    """While entered, plain graph modules a lowering builds in this context write their code
    once, when the outermost scope exits; none leaves it lazy."""
    outermost = _built_here.get() is None
    token = _built_here.set([]) if outermost else None
    try:
        with PATCH.scope():
            yield
    finally:
        if outermost:
            built = _built_here.get()
            _built_here.reset(token)
            _made_torchs(built)
