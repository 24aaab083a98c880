# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""One driver for node-local passes on an ExportedProgram: match every node,
then rewrite a working copy only when something matched.

The program handed in may be the user's (upstream passes the user's program to
`transform_for_pre_decomposition`), so it is never rewritten: when a match is
found, the matches are taken again on a copy and that copy is rewritten and
returned. Declines are recorded once, from the first scan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch.export import ExportedProgram

from etfold.decisions import Declined, record_declined
from etfold.exir.program.working_copy import copy_for_rewrite

Match = TypeVar("Match")


def matches_in(
    program: ExportedProgram,
    match: Callable[[torch.fx.Node], Match | Declined | None],
    fold: str | None = None,
) -> list[Match]:
    """Every node's match, in graph order; each Declined is recorded under `fold`."""
    found = []
    for node in program.graph.nodes:
        result = match(node)
        if isinstance(result, Declined):
            if fold is not None:
                record_declined(fold, node.name, result.reason)
        elif result is not None:
            found.append(result)
    return found


def rewrite_matches_on_a_copy(
    program: ExportedProgram,
    match: Callable[[torch.fx.Node], Match | Declined | None],
    rewrite: Callable[[Match], None],
    fold: str,
) -> ExportedProgram:
    """`program` itself when nothing matches; else a copy with every match rewritten."""
    if not matches_in(program, match, fold):
        return program
    program = copy_for_rewrite(program)
    for found in matches_in(program, match):
        rewrite(found)
    program.graph_module.recompile()
    return program
