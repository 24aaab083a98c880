# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Every method of the upstream lowering a pre-decomposition hook runs in.

Upstream's `to_edge_transform_and_lower` hands `transform_for_pre_decomposition`
one method's program. Whether a buffer may fold depends on the other methods
(one may write it, several may read it), and upstream has no hook that sees
them all. Its `_gen_edge_manager_for_partitioners` holds them while it calls the
hooks, one method at a time: its parameter `aten_programs` (every method's
program) and its loop variable `name` (the method at hand). This module reads
that frame, and only reads it. Outside such a call (a hook called directly)
there is no answer, and a fold must take every buffer as possibly written.

Upstream may rename those locals. So the first read checks that upstream's
function still has them (`lowering_code`) and raises `UpstreamLoweringChanged`
if not: a lowering through upstream's entry point must never silently lose the
cross-method marks. etfold's own entry point marks every method before any hook
runs, and its hooks then read no frame.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import CodeType

from executorch.exir.program import _program
from torch.export import ExportedProgram

_LOWERING = "executorch.exir.program._program._gen_edge_manager_for_partitioners"
_PROGRAMS_PARAMETER = "aten_programs"  # method -> ATen program, as its caller passed them
_METHOD_LOCAL = "name"  # the method whose hooks run
_HOOK_CALLER = "_apply_pre_decomposition_transforms"  # what calls the hooks, from that frame

# taken at import: a wrapper put in its place later (a test counting calls) is looked through
_UPSTREAM_LOWERING = getattr(_program, _LOWERING.rsplit(".", 1)[1], None)


class UpstreamLoweringChanged(RuntimeError):
    """Upstream's lowering no longer holds the methods where etfold reads them."""


def lowering_code(function: object) -> CodeType:
    """`function`'s code, checked to hold what this module reads: `aten_programs` a
    parameter, `name` a local, and the call of the hooks. Raises
    `UpstreamLoweringChanged`, naming what is missing, when it does not."""
    code = getattr(function, "__code__", None)
    if code is None:
        raise UpstreamLoweringChanged(f"{_LOWERING} is gone: {_advice()}")
    parameters = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    held = {
        f"parameter `{_PROGRAMS_PARAMETER}`": _PROGRAMS_PARAMETER in parameters,
        f"local `{_METHOD_LOCAL}`": _METHOD_LOCAL in code.co_varnames,
        f"call of `{_HOOK_CALLER}`": _HOOK_CALLER in code.co_names,
    }
    missing = [what for what, present in held.items() if not present]
    if missing:
        raise UpstreamLoweringChanged(
            f"{_LOWERING} no longer has the {', '.join(missing)} that etfold reads to see "
            f"every method of the lowering: {_advice()}"
        )
    return code


def _advice() -> str:
    return (
        "etfold's XNNPACK partitioner cannot mark what other methods do through upstream's "
        "to_edge_transform_and_lower on this executorch; lower through "
        "etfold.exir.to_edge_transform_and_lower, which marks every method itself"
    )


@dataclass(frozen=True)
class UpstreamLowering:
    """The user's programs, by method, and the method whose hook is running."""

    programs: Mapping[str, ExportedProgram]
    method: str


def upstream_lowering_in_progress() -> UpstreamLowering | None:
    """The innermost upstream lowering on this thread's stack, or None. Raises
    `UpstreamLoweringChanged` when upstream's lowering no longer holds its methods
    where this reads them."""
    lowering = lowering_code(_UPSTREAM_LOWERING)
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not lowering:
        frame = frame.f_back
    if frame is None:
        return None
    programs = frame.f_locals.get(_PROGRAMS_PARAMETER)
    method = frame.f_locals.get(_METHOD_LOCAL)
    if not isinstance(programs, Mapping) or method not in programs:
        return None
    if not all(isinstance(p, ExportedProgram) for p in programs.values()):
        return None
    return UpstreamLowering(programs, method)
