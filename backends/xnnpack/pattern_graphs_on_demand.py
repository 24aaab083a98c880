# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""XNNPACK's preprocess builds its match patterns only for a graph they could match.

Two of upstream's XNNPACK preprocess passes, `ConvertToSDPAPass` and
`ConvertToUpsampleBilinear2d`, match every delegate's graph against pattern
graphs that upstream exports and lowers to edge on first use: 3 s and 3.5 s on
2 cores, once per process, several times the lowering of a small model. torch's
`SubgraphMatcher` pairs a pattern's op node only with a graph node of the same
target, and every SDPA pattern holds `_softmax`, every bilinear one
`upsample_bilinear2d.vec` (`test_pattern_graphs_on_demand.py` checks upstream's
patterns). Inside `patterns_on_demand()` such a pass, given a graph without its
op, runs upstream's own `call` over no patterns, which is what matching them
would find; otherwise it runs untouched. Same program, same bytes; the scope
undoes itself on exit and acts only in the context that entered it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
from dataclasses import dataclass

from etfold.exir.program.reentrant_patch import PatchUnavailable, ReentrantPatch, Replacement


@dataclass(frozen=True)
class PatternUser:
    """An upstream pass that matches the graphs one function of a patterns module returns."""

    pass_module: str
    pass_class: str
    patterns_module: str
    patterns_function: str
    anchor: str  # `<namespace>.<op>.<overload>` of an edge op every pattern holds
    no_patterns: type  # what the function returns when there are none (list, dict)

    def anchor_op(self):
        from executorch.exir.dialects._ops import ops as exir_ops

        namespace, op, overload = self.anchor.split(".")
        return getattr(getattr(getattr(exir_ops.edge, namespace), op), overload)


PATTERN_USERS = (
    PatternUser(
        "executorch.backends.xnnpack._passes.convert_to_sdpa",
        "ConvertToSDPAPass",
        "executorch.backends.xnnpack.partition.graphs.sdpa",
        "get_graphs",
        "aten._softmax.default",
        list,
    ),
    PatternUser(
        "executorch.backends.xnnpack._passes.convert_to_upsample_bilinear2d",
        "ConvertToUpsampleBilinear2d",
        "executorch.backends.xnnpack.partition.graphs.bilinear_2d",
        "get_graphs_dict",
        "aten.upsample_bilinear2d.vec",
        dict,
    ),
)

# the PatternUsers whose pass is running, in this context, on a graph without its anchor
_unmatchable: contextvars.ContextVar[frozenset[PatternUser]] = contextvars.ContextVar(
    "etfold_xnnpack_unmatchable_patterns", default=frozenset()
)


def holds_op(graph, op) -> bool:
    """Some node of `graph` calls `op`, compared as `SubgraphMatcher` compares targets."""
    return any(node.op == "call_function" and op == node.target for node in graph.nodes)


def _call_skipping_unmatchable(user: PatternUser, anchor):
    def make(call):
        @functools.wraps(call)
        def on_demand(self, graph_module):
            if holds_op(graph_module.graph, anchor):
                return call(self, graph_module)
            token = _unmatchable.set(_unmatchable.get() | {user})
            try:
                return call(self, graph_module)
            finally:
                _unmatchable.reset(token)

        return on_demand

    return make


def _patterns_unless_unmatchable(user: PatternUser):
    def make(patterns):
        @functools.wraps(patterns)
        def on_demand():
            return user.no_patterns() if user in _unmatchable.get() else patterns()

        return on_demand

    return make


def _replacements_for(user: PatternUser) -> list[Replacement]:
    try:
        pass_class = getattr(importlib.import_module(user.pass_module), user.pass_class)
        patterns_module = importlib.import_module(user.patterns_module)
        anchor = user.anchor_op()
    except (ImportError, AttributeError) as error:
        raise PatchUnavailable(f"{user.pass_class}: {error}") from None
    return [
        Replacement(pass_class, "call", _call_skipping_unmatchable(user, anchor)),
        Replacement(patterns_module, user.patterns_function, _patterns_unless_unmatchable(user)),
    ]


PATCH = ReentrantPatch(
    "patterns_on_demand",
    lambda: [r for user in PATTERN_USERS for r in _replacements_for(user)],
)


def patterns_on_demand() -> contextlib.AbstractContextManager[None]:
    """While entered, in this context, XNNPACK's preprocess builds no pattern graphs for a
    delegate graph that lacks their op."""
    return PATCH.scope()
