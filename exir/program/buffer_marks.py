# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Which buffers a fold may read as constants, decided over every method at once.

A pre-decomposition hook sees one method. A buffer that method only reads may
still be written by another method, or read by several (folding it in one
method would duplicate it). `mark_buffer_fold_blockers` runs in
`etfold.exir.to_edge_transform_and_lower`, which sees every method, and gives
every buffer placeholder a verdict in `meta[BUFFER_FOLD_BLOCKERS]`: a tuple of
reasons, empty when no method writes the buffer and at most one method reads it.

A buffer without the key was never judged (the program came through upstream's
entry point), so a fold must treat it as possibly written.

Programs are not functionalized yet when this runs, so a write is an in-place
op on the buffer or on a view of it, a custom op whose schema marks that
argument mutable, or an op whose schema is unknown; a functionalized program's
BUFFER_MUTATION outputs count as writes too. An autocast or grad-mode region
writes a buffer when its body does (its results are taken as views of it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from etfold.exir.passes.graph_walk import state_placeholders
from etfold.exir.passes.graph_walk import state_writes as graph_state_writes

BUFFER_FOLD_BLOCKERS = "etfold_buffer_fold_blockers"


def buffer_placeholders(program: ExportedProgram) -> dict[str, torch.fx.Node]:
    """Buffer FQN -> its placeholder."""
    return state_placeholders(program, frozenset({InputKind.BUFFER}))


def state_writes(program: ExportedProgram) -> dict[str, list[str]]:
    """Parameter/buffer/constant FQN -> what in this program may write it (empty lists omitted)."""
    fqn_of = {node: fqn for fqn, node in state_placeholders(program).items()}
    writes: dict[str, list[str]] = defaultdict(list)
    for write in graph_state_writes(program.graph_module, program):
        fqn = fqn_of.get(write.destination)
        if fqn is not None:
            writes[fqn].append(write.how)
    return dict(writes)


def buffer_writes(program: ExportedProgram) -> dict[str, list[str]]:
    """Buffer FQN -> what in this program may write it (empty lists omitted)."""
    buffers = buffer_placeholders(program)
    return {fqn: ops for fqn, ops in state_writes(program).items() if fqn in buffers}


def mark_buffer_fold_blockers(programs: Mapping[str, ExportedProgram]) -> None:
    """Give every buffer placeholder of every method its fold verdict (see module doc)."""
    writers: dict[str, list[str]] = defaultdict(list)
    readers: dict[str, list[str]] = defaultdict(list)
    for method, program in programs.items():
        for fqn, ops in buffer_writes(program).items():
            writers[fqn].append(f"method `{method}` may write it ({', '.join(sorted(set(ops)))})")
        for fqn, placeholder in buffer_placeholders(program).items():
            if placeholder.users:
                readers[fqn].append(method)
    for program in programs.values():
        for fqn, placeholder in buffer_placeholders(program).items():
            blockers = list(writers.get(fqn, ()))
            if len(readers.get(fqn, ())) > 1:
                blockers.append(f"methods {', '.join(sorted(readers[fqn]))} all read it")
            placeholder.meta[BUFFER_FOLD_BLOCKERS] = tuple(blockers)
