# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Marks that tell a one-method pre-decomposition hook what the other methods do."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping

from torch.export import ExportedProgram

from etfold.exir.passes.graph_walk import state_placeholders

SHARED_ACROSS_METHODS = "shared_across_methods"


def _constant_placeholders(program: ExportedProgram):
    return ((node, fqn) for fqn, node in state_placeholders(program).items())


def mark_constants_shared_across_methods(programs: Mapping[str, ExportedProgram]) -> None:
    """`meta["shared_across_methods"] = True` on each constant that several methods read.

    Constants are matched by fully qualified name; a placeholder with no users is
    not a read. Marks left by an earlier call are recomputed, not accumulated.
    """
    readers: dict[str, set[str]] = defaultdict(set)
    for method, program in programs.items():
        for node, fqn in _constant_placeholders(program):
            if node.users:
                readers[fqn].add(method)
    for program in programs.values():
        for node, fqn in _constant_placeholders(program):
            if len(readers[fqn]) > 1:
                node.meta[SHARED_ACROSS_METHODS] = True
            else:
                node.meta.pop(SHARED_ACROSS_METHODS, None)


MarkingStep = Callable[[Mapping[str, ExportedProgram]], None]


METHODS_JUDGED = "etfold_methods_judged"  # graph_module.meta: the marking steps ran on this program


def mark_methods(programs: Mapping[str, ExportedProgram], steps: tuple[MarkingStep, ...]) -> None:
    """Apply each marking step, in order, to every method of one lowering; each program's
    `graph_module.meta[METHODS_JUDGED]` then says its marks are computed."""
    for step in steps:
        step(programs)
    for program in programs.values():
        program.graph_module.meta[METHODS_JUDGED] = True


def methods_judged(program: ExportedProgram) -> bool:
    return bool(program.graph_module.meta.get(METHODS_JUDGED, False))
