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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.export import ExportedProgram

from etfold.backends.xnnpack.partition.weight_fold import carry_placeholder_marks


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
    decomposed = program.run_decompositions(table)
    carry_placeholder_marks(program, decomposed)
    return decomposed
