# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Graph modules an ExportPass builds write their Python code when it is first read.

A `GraphModule` generates and compiles Python source for its graph when it is
built and at every `recompile()`. ExecuTorch's `ExportPass` builds a new graph
module for every pass it runs (and an empty one per pass object), and pass
managers recompile each result, yet the next pass reads only the graph: a tenth
to a fifth of a lowering goes to source nobody runs. Inside
`code_on_first_use_for_pass_modules()` the modules `ExportPass` builds are
torch's own `_LazyGraphModule`, which generates the same code from the same
graph on the first call, `.code` read or pickle. Every other graph module
(exported programs, unlifted modules, the user's) is built as torch builds it.
The scope undoes itself on exit; where torch's internals are not the ones this
was written against, it changes nothing.
"""

from __future__ import annotations

import contextlib
import sys

from torch.fx import GraphModule

from etfold.exir.program.reentrant_patch import ReentrantPatch

_saved: list = []
_builders: set = set()


def _lazy_class():
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:
        return None
    return _LazyGraphModule


def _pass_builders() -> set:
    """The code objects of the ExportPass methods that build graph modules."""
    from executorch.exir.pass_base import _ExportPassBase

    methods = (_ExportPassBase.__init__, _ExportPassBase.call_submodule)
    return {m.__code__ for m in methods if hasattr(m, "__code__")}


def _lazy_when_built_by_a_pass(new, lazy):
    def __new__(cls, *args, **kwargs):
        if cls is GraphModule and sys._getframe(1).f_code in _builders:
            cls = lazy
        return new(cls, *args, **kwargs)

    return staticmethod(__new__)


def _install() -> None:
    lazy, new = _lazy_class(), GraphModule.__dict__.get("__new__")
    if lazy is None or not isinstance(new, staticmethod):
        return
    _builders.update(_pass_builders())
    _saved.append(new)
    GraphModule.__new__ = _lazy_when_built_by_a_pass(new.__func__, lazy)


def _uninstall() -> None:
    if _saved:
        GraphModule.__new__ = _saved.pop()
    _builders.clear()


_PATCH = ReentrantPatch(_install, _uninstall)


def code_on_first_use_for_pass_modules() -> contextlib.AbstractContextManager[None]:
    """While entered, graph modules ExportPass builds generate their code on first use."""
    return _PATCH.scope()
