# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Every method of the upstream lowering a pre-decomposition hook runs in.

Upstream's `to_edge_transform_and_lower` hands `transform_for_pre_decomposition`
one method's program. Whether a buffer may fold depends on the other methods
(one may write it, several may read it), and upstream has no hook that sees
them all. Its `_gen_edge_manager_for_partitioners` holds them in a local while
it calls the hooks, one method at a time: this module reads that frame, and
only reads it. Outside such a call (a hook called directly) there is no answer,
and a fold must take every buffer as possibly written.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass

from executorch.exir.program import _program
from torch.export import ExportedProgram

# the upstream function whose locals hold the method -> ATen program dict and the method at hand
_LOWERING_CODE = _program._gen_edge_manager_for_partitioners.__code__
_PROGRAMS_LOCAL = "aten_programs"
_METHOD_LOCAL = "name"


@dataclass(frozen=True)
class UpstreamLowering:
    """The user's programs, by method, and the method whose hook is running."""

    programs: Mapping[str, ExportedProgram]
    method: str


def upstream_lowering_in_progress() -> UpstreamLowering | None:
    """The innermost upstream lowering on this thread's stack, or None."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not _LOWERING_CODE:
        frame = frame.f_back
    if frame is None:
        return None
    programs = frame.f_locals.get(_PROGRAMS_LOCAL)
    method = frame.f_locals.get(_METHOD_LOCAL)
    if not isinstance(programs, Mapping) or method not in programs:
        return None
    if not all(isinstance(p, ExportedProgram) for p in programs.values()):
        return None
    return UpstreamLowering(programs, method)
