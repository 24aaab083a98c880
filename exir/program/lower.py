# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""`to_edge_transform_and_lower` with etfold's multi-method bookkeeping.

Same signature as upstream's. It lowers working copies of the user's programs
(graph, metadata and signature copied; tensors shared), so the user's
`ExportedProgram`s come back exactly as they went in. Before deferring to
upstream it applies each marking step in `MARKING_STEPS` to the method -> copy
dict, so pre-decomposition hooks (which see one method) know what other
methods do. Whatever etfold installed into upstream for this lowering is gone
when the call returns or raises. The returned manager checks the external
constant map at `to_executorch()`.
"""

from __future__ import annotations

from executorch.exir import EdgeProgramManager
from executorch.exir import to_edge_transform_and_lower as _upstream_to_edge_transform_and_lower
from torch.export import ExportedProgram

from etfold.exir.emit.external_constants import check_external_constant_names
from etfold.exir.program.buffer_marks import mark_buffer_fold_blockers
from etfold.exir.program.method_marks import (
    MarkingStep,
    mark_constants_shared_across_methods,
)
from etfold.exir.program.working_copy import copy_for_rewrite

# Applied in order to the method -> ATen program dict before upstream runs.
MARKING_STEPS: tuple[MarkingStep, ...] = (
    mark_constants_shared_across_methods,
    mark_buffer_fold_blockers,
)


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
    for step in MARKING_STEPS:
        step(copies)
    with _installs_scoped_to_this_call():
        manager = _upstream_to_edge_transform_and_lower(
            copies if isinstance(programs, dict) else copies["forward"],
            transform_passes=transform_passes,
            partitioner=partitioner,
            constant_methods=constant_methods,
            compile_config=compile_config,
            generate_etrecord=generate_etrecord,
        )
    return CheckedEdgeProgramManager.adopt(manager)


def _installs_scoped_to_this_call():
    from etfold.backends.xnnpack.install import holds_released_on_exit

    return holds_released_on_exit()
