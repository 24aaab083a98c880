# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""`to_edge_transform_and_lower` with etfold's multi-method bookkeeping.

Same signature as upstream's. It lowers working copies of the user's programs
(graph, metadata and signature copied; tensors shared), so the user's
`ExportedProgram`s come back exactly as they went in. Before deferring to
upstream it marks the copies (`mark_for_lowering`: each step in
`MARKING_STEPS`, over every method at once), so pre-decomposition hooks, which
see one method, know what the other methods do; a partitioner lowered through
upstream's entry point computes the same marks itself. The scopes backends
register (`lowering_scopes`) are entered around the call, so whatever a
backend installed into upstream for it is gone when it returns or raises, and
torch does less work for the same result (`torch_speedups`). The lowered
programs keep the size bounds the export declared, or the call refuses naming the
one it narrowed (`declared_bounds`). In the returned
programs, which the lowering made, constants that share a name across methods
but not their data are renamed apart, so an external constant map
(`to_executorch` with `external_constants`) gives each method its own data.
"""

from __future__ import annotations

from collections.abc import Mapping

from executorch.exir import EdgeProgramManager
from executorch.exir import to_edge_transform_and_lower as _upstream_to_edge_transform_and_lower
from torch.export import ExportedProgram

from etfold.exir.emit.external_constants import give_distinct_data_distinct_names
from etfold.exir.program.buffer_marks import mark_buffer_fold_blockers
from etfold.exir.program.declared_bounds import bounds_kept
from etfold.exir.program.lowering_scopes import lowering_scopes
from etfold.exir.program.method_marks import (
    MarkingStep,
    mark_constants_shared_across_methods,
    mark_methods,
)
from etfold.exir.program.speedups import torch_speedups
from etfold.exir.program.working_copy import copy_for_rewrite

# Applied in order to the method -> ATen program dict before upstream runs.
MARKING_STEPS: tuple[MarkingStep, ...] = (
    mark_constants_shared_across_methods,
    mark_buffer_fold_blockers,
)


def mark_for_lowering(programs: Mapping[str, ExportedProgram]) -> None:
    """Every marking step over the methods of one lowering (etfold's copies, never the user's)."""
    mark_methods(programs, MARKING_STEPS)


def to_edge_transform_and_lower(
    programs: ExportedProgram | dict[str, ExportedProgram],
    transform_passes=None,
    partitioner=None,
    constant_methods=None,
    compile_config=None,
    generate_etrecord: bool = False,
    *,
    speedups: bool | None = None,
) -> EdgeProgramManager:
    """Upstream's lowering of etfold's marked copies (see module doc).

    `speedups`: enter `torch_speedups()` around the call (same bytes, less time); None
    follows the `ETFOLD_SPEEDUPS` environment variable (on unless it says 0).
    """
    by_method = programs if isinstance(programs, dict) else {"forward": programs}
    copies = {
        method: copy_for_rewrite(program) if isinstance(program, ExportedProgram) else program
        for method, program in by_method.items()
    }
    mark_for_lowering(copies)
    aten_programs = {m: p for m, p in copies.items() if isinstance(p, ExportedProgram)}
    with bounds_kept(aten_programs), lowering_scopes(), torch_speedups(speedups):
        manager = _upstream_to_edge_transform_and_lower(
            copies if isinstance(programs, dict) else copies["forward"],
            transform_passes=transform_passes,
            partitioner=partitioner,
            constant_methods=constant_methods,
            compile_config=compile_config,
            generate_etrecord=generate_etrecord,
        )
    give_distinct_data_distinct_names(
        {method: manager.exported_program(method) for method in manager.methods}
    )
    return manager
