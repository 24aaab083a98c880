# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""One driver for node-local passes: match every node, record each decline,
rewrite each match.

On an ExportedProgram (`rewrite_matches_on_a_copy`), a working copy is rewritten
only when something matched, each node matched there after the rewrites of the
nodes before it. On a graph module a backend pass manager owns
(`rewrite_each_match`), each match is rewritten in place as it is found.

The program handed in may be the user's (upstream passes the user's program to
`transform_for_pre_decomposition`), so it is never rewritten: when a match is
found, the matches are taken again on a copy and that copy is rewritten and
returned. Declines are recorded once, from the first scan.

A pass whose verdicts read the program itself (its state, its values at every
size) judges once, on the program handed in (`rewrite_judged_on_a_copy`); the
copy's nodes keep their names, so each match there is built from the verdict its
namesake got.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch.export import ExportedProgram

from etfold.decisions import Declined, record_applied, record_declined
from etfold.exir.passes.node_shapes import node_value
from etfold.exir.program.working_copy import copy_for_rewrite

Match = TypeVar("Match")
Verdict = TypeVar("Verdict")


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
    on_copy: Callable[[ExportedProgram], None] | None = None,
) -> ExportedProgram:
    """`program` itself when nothing matches; else a copy with every match rewritten
    (handed to `on_copy` first, for a rewrite that adds to the program, not only its graph).
    Raises `SizeFixedByRewrite` when matching or rewriting fixed a symbolic size."""
    fixed = fixed_sizes(program)
    if not matches_in(program, match, fold):
        _check_sizes_kept(program, fixed, fold)
        return program
    copied = copy_for_rewrite(program)
    if on_copy is not None:
        on_copy(copied)
    for node in list(copied.graph.nodes):
        # each node is matched on the graph the rewrites before it left: a match taken
        # earlier could name a node an earlier rewrite erased (a layer norm of a layer
        # norm reads the getitem the first rewrite removes); torch marks such a node
        if node._erased:
            continue
        found = match(node)
        if found is not None and not isinstance(found, Declined):
            rewrite(found)
    copied.graph_module.recompile()
    _check_sizes_kept(copied, fixed, fold)
    return copied


class SizeFixedByRewrite(RuntimeError):
    """A pass fixed a symbolic size of a dynamic program at a number: the program would
    be retraced at that size and run at no other. A bug in the pass, never a decision."""


def fixed_sizes(program: ExportedProgram) -> dict[str, object]:
    """The symbolic sizes the program's shape environment has fixed at a number."""
    from torch._guards import detect_fake_mode

    values = [node_value(n) for n in program.graph.nodes if n.op == "placeholder"]
    shape_env = getattr(detect_fake_mode(values), "shape_env", None)
    if shape_env is None:
        return {}
    return {str(s): v for s, v in shape_env.replacements.items() if v.is_number}


def _check_sizes_kept(program: ExportedProgram, before: dict[str, object], fold: str) -> None:
    # running an op's meta function on a fake value can install such a replacement silently
    # (permute_copy, constant_pad_nd): the retrace in decomposition then specializes the
    # whole program, which fails at runtime at any other size
    fixed = {name: value for name, value in fixed_sizes(program).items() if name not in before}
    if fixed:
        sizes = ", ".join(f"{name} = {value}" for name, value in fixed.items())
        raise SizeFixedByRewrite(f"{fold} fixed the symbolic sizes {sizes} of a dynamic program")


def rewrite_judged_on_a_copy(
    program: ExportedProgram,
    judge: Callable[[torch.fx.Node], Verdict | Declined | None],
    match: Callable[[torch.fx.Node, Verdict], Match],
    rewrite: Callable[[Match], None],
    fold: str,
    on_copy: Callable[[ExportedProgram], None] | None = None,
) -> ExportedProgram:
    """`rewrite_matches_on_a_copy` with every node judged once, on `program`: `judge`
    gives a node's verdict (None: nothing to decide), and on the copy `match(node,
    verdict)` builds the match of the node named as the one judged. Judging is checked
    for fixed sizes as matching and rewriting are."""
    fixed = fixed_sizes(program)
    judged = {
        node.name: verdict for node in program.graph.nodes if (verdict := judge(node)) is not None
    }
    _check_sizes_kept(program, fixed, fold)
    if not judged:
        return program

    def judged_match(node: torch.fx.Node) -> Match | Declined | None:
        verdict = judged.get(node.name)
        if verdict is None or isinstance(verdict, Declined):
            return verdict
        return match(node, verdict)

    return rewrite_matches_on_a_copy(program, judged_match, rewrite, fold, on_copy)


def rewrite_each_match(
    nodes: Iterable[torch.fx.Node],
    match: Callable[[torch.fx.Node], Match | Declined | None],
    rewrite: Callable[[Match], str],
    fold: str,
    where: Callable[[torch.fx.Node], str] = lambda node: node.name,
) -> bool:
    """Match each node in order and rewrite each match at once, so a later match sees
    the graph earlier rewrites left; `rewrite` returns the detail recorded as applied.
    True when anything was rewritten: the caller recompiles (and retraces) once."""
    modified = False
    for node in nodes:
        found = match(node)
        if found is None:
            continue
        if isinstance(found, Declined):
            record_declined(fold, where(node), found.reason)
            continue
        place = where(node)
        record_applied(fold, place, rewrite(found))
        modified = True
    return modified
