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
torch does less work for the same result (`torch_speedups`). The returned
manager checks the external constant map at `to_executorch()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from executorch.exir import EdgeProgramManager
from executorch.exir import to_edge_transform_and_lower as _upstream_to_edge_transform_and_lower
from torch.export import ExportedProgram

from etfold.exir.emit.external_constants import check_external_constant_names
from etfold.exir.program.buffer_marks import mark_buffer_fold_blockers
from etfold.exir.program.composite_op_lookup import one_composite_op_lookup_per_walk
from etfold.exir.program.composite_op_overrides import one_override_write_per_composite_op
from etfold.exir.program.edge_dtype_check_once import edge_dtype_check_once_per_graph
from etfold.exir.program.lazy_graph_modules import code_on_first_use_for_graph_modules
from etfold.exir.program.lowering_scopes import lowering_scopes
from etfold.exir.program.method_marks import (
    MarkingStep,
    mark_constants_shared_across_methods,
    mark_methods,
)
from etfold.exir.program.preservable_op_checks import fixed_preservability_checked_once
from etfold.exir.program.py_kernel_closures import one_py_kernel_closure_per_key
from etfold.exir.program.shared_provenance import shared_provenance_chains
from etfold.exir.program.working_copy import copy_for_rewrite

# Applied in order to the method -> ATen program dict before upstream runs.
MARKING_STEPS: tuple[MarkingStep, ...] = (
    mark_constants_shared_across_methods,
    mark_buffer_fold_blockers,
)


@contextlib.contextmanager
def torch_speedups():
    """Torch's own lowering work, minus repeats: one composite-op lookup per walk, an op's
    schema judged once, one write of each composite op's override kernels, one kernel
    registration closure per op and key, provenance chains shared instead of deep-copied,
    a graph module's Python code written when first used, not at every build and pass,
    and the edge verifier's dtype check run once per graph, not per program built over it.

    Programs come out byte-identical; torch is as it was once the scope exits.
    """
    with (
        one_composite_op_lookup_per_walk(),
        fixed_preservability_checked_once(),
        one_override_write_per_composite_op(),
        one_py_kernel_closure_per_key(),
        shared_provenance_chains(),
        code_on_first_use_for_graph_modules(),
        edge_dtype_check_once_per_graph(),
    ):
        yield


def mark_for_lowering(programs: Mapping[str, ExportedProgram]) -> None:
    """Every marking step over the methods of one lowering (etfold's copies, never the user's)."""
    mark_methods(programs, MARKING_STEPS)


class CheckedEdgeProgramManager(EdgeProgramManager):
    """Upstream's EdgeProgramManager whose `to_executorch` rejects external-constant collisions.

    Adds no state; managers derived through `transform` / `to_backend` stay checked.
    """

    @classmethod
    def adopt(cls, manager: EdgeProgramManager) -> CheckedEdgeProgramManager:
        if not isinstance(manager, EdgeProgramManager):
            raise TypeError(
                f"expected an EdgeProgramManager from upstream, got {type(manager).__name__}"
            )
        manager.__class__ = cls
        return manager

    def transform(self, *args, **kwargs):
        return self.adopt(super().transform(*args, **kwargs))

    def to_backend(self, *args, **kwargs):
        return self.adopt(super().to_backend(*args, **kwargs))

    def to_executorch(self, *args, **kwargs):
        executorch = super().to_executorch(*args, **kwargs)
        check_external_constant_names(
            {m: executorch.exported_program(m) for m in executorch.methods}
        )
        return executorch


def to_edge_transform_and_lower(
    programs: ExportedProgram | dict[str, ExportedProgram],
    transform_passes=None,
    partitioner=None,
    constant_methods=None,
    compile_config=None,
    generate_etrecord: bool = False,
) -> CheckedEdgeProgramManager:
    by_method = programs if isinstance(programs, dict) else {"forward": programs}
    copies = {
        method: copy_for_rewrite(program) if isinstance(program, ExportedProgram) else program
        for method, program in by_method.items()
    }
    mark_for_lowering(copies)
    with lowering_scopes(), torch_speedups():
        manager = _upstream_to_edge_transform_and_lower(
            copies if isinstance(programs, dict) else copies["forward"],
            transform_passes=transform_passes,
            partitioner=partitioner,
            constant_methods=constant_methods,
            compile_config=compile_config,
            generate_etrecord=generate_etrecord,
        )
    return CheckedEdgeProgramManager.adopt(manager)
