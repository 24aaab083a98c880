# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The program a pre-decomposition pass should see when the op it rewrites only
appears once the lowering decomposes another one (a batched `matmul` writes its
expands, `scaled_dot_product_attention` its softmax guard).

The decomposition uses the lowering's own table, so the pass sees what upstream
would partition next anyway; placeholder marks that a retrace drops are carried.
Inside `decompositions_shared()` (one lowering's rewrites), a program is decomposed
with one table once: a pass that rewrites nothing hands on the program it was given,
and the next pass would decompose it again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar

import torch
from torch.export import ExportedProgram

from etfold.backends.xnnpack.partition.weight_fold import carry_placeholder_marks

# (id(program), table items) -> (program, decomposed): the program is held, so its id
# names it alone while the memo lives
_SHARED: ContextVar[dict | None] = ContextVar("etfold_shared_decompositions", default=None)


@contextlib.contextmanager
def decompositions_shared() -> Iterator[None]:
    """Within, in this context only: `decomposed_for` reuses a decomposition of the same
    program with the same table. Each pass reads the decomposed program and rewrites a
    copy of it, so sharing it is safe."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def _decomposed(program: ExportedProgram, table: Mapping) -> ExportedProgram:
    shared = _SHARED.get()
    key = (id(program), frozenset(table.items()))
    if shared is not None and key in shared:
        return shared[key][1]
    decomposed = program.run_decompositions(table)
    carry_placeholder_marks(program, decomposed)
    if shared is not None:
        shared[key] = (program, decomposed)
    return decomposed


def decomposed_for(
    program: ExportedProgram,
    table: Mapping | None,
    needs_it: Callable[[torch.fx.Node], bool],
) -> ExportedProgram:
    """`program` decomposed with `table` when some node the table decomposes
    `needs_it`; else `program` itself."""
    if not table:
        return program
    wanted = (
        node
        for node in program.graph.nodes
        if node.op == "call_function" and node.target in table and needs_it(node)
    )
    if next(wanted, None) is None:
        return program
    return _decomposed(program, table)
