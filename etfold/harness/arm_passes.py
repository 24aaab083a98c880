# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Run extra passes inside ArmPassManager's backend pipeline for one block.

Tests use this to place a pass exactly where registration would, without
registering anything globally beyond the `with` block, and to read the
annotation pipeline as registration leaves it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence


@contextlib.contextmanager
def arm_pass_insertions(
    before: Mapping[type, Sequence[object]] | None = None,
    after: Mapping[type, Sequence[object]] | None = None,
) -> Iterator[None]:
    """Insert pass instances before/after upstream pass types; remove exactly them on exit."""
    from etfold.backends.arm.pass_insertions import add_pass_insertions, remove_pass_insertions

    entries = [
        (target, side, instance)
        for side, table in (("before", before or {}), ("after", after or {}))
        for target, passes in table.items()
        for instance in passes
    ]
    created = add_pass_insertions(entries)
    try:
        yield
    finally:
        remove_pass_insertions(entries, created)


def annotation_pipeline_passes(profile: str = "TOSA-1.0+INT") -> list[type]:
    """The pass classes of Arm's annotation pipeline as it is built now, in order."""
    from etfold.backends.arm.pass_insertions import built_annotation_pipeline

    return [type(p) for p in built_annotation_pipeline(profile).passes]


def lower_tosa_with_passes(
    program,
    *,
    before: Mapping[type, Sequence[object]] | None = None,
    after: Mapping[type, Sequence[object]] | None = None,
    profile: str | None = None,
):
    """`lower_tosa(program)` with extra passes inserted for this lowering only.

    The program is deep-copied first, so the same quantized program can be
    lowered again (with other passes, or none) for a side-by-side comparison.
    """
    import copy

    from etfold.harness.tosa_runner import INT, lower_tosa

    with arm_pass_insertions(before, after):
        return lower_tosa(copy.deepcopy(program), profile or INT)


def lower_tosa_without_and_with_passes(
    program,
    *,
    before: Mapping[type, Sequence[object]] | None = None,
    after: Mapping[type, Sequence[object]] | None = None,
    profile: str | None = None,
):
    """`lower_tosa_with_passes(program)`, then with `before`/`after` inserted and the fold
    decisions that second lowering records; one edge stage for both.

    Inserted passes run in the TOSA backend pipeline, after the edge stage (a third to
    two thirds of a TOSA INT lowering), so the second lowering starts from a deep copy
    of the first's edge programs. Where the edge stage recorded a fold decision, the
    second lowering runs its own, so its decisions are complete.
    """
    from etfold.decisions import collect_decisions

    with _edge_stage_replayed():
        without = lower_tosa_with_passes(program, profile=profile)
        with collect_decisions() as decisions:
            with_passes = lower_tosa_with_passes(
                program, before=before, after=after, profile=profile
            )
    return without, with_passes, decisions


@contextlib.contextmanager
def _edge_stage_replayed() -> Iterator[None]:
    """Inside, upstream's edge stage runs once; later lowerings get a deep copy of its result."""
    import copy

    from executorch.exir.program import _program

    from etfold.decisions import collect_decisions

    original = _program._gen_edge_manager_for_partitioners
    recorded: list = []

    def edge_stage(partitioner, aten_programs, config, *args, **kwargs):
        if recorded:
            manager, exceptions = recorded
            config._core_aten_ops_exception_list = list(exceptions)  # upstream's side effect
            return copy.deepcopy(manager, {id(manager.compile_config): config})
        with collect_decisions() as decisions:
            manager = original(partitioner, aten_programs, config, *args, **kwargs)
        if not decisions:
            recorded[:] = [copy.deepcopy(manager), list(config._core_aten_ops_exception_list)]
        return manager

    _program._gen_edge_manager_for_partitioners = edge_stage
    try:
        yield
    finally:
        _program._gen_edge_manager_for_partitioners = original


def _export_pass_base():
    from executorch.exir.pass_base import ExportPass

    return ExportPass


class CapturePass(_export_pass_base()):
    """Snapshots the program being lowered (a deep copy) and stops the lowering.

    Insert it with `arm_pass_insertions` where a pass under test would run, then
    `lower_until_probe`; `snapshot` is the program exactly as that pass would see it.
    """

    def __init__(self):
        super().__init__()
        self.exported_program = None  # set by ArmPassManager's adapter
        self.snapshot = None

    def call(self, graph_module):
        import copy

        self.snapshot = copy.deepcopy(self.exported_program)
        raise ProbeStop


def program_at(program, *, before=None, after=None, capture_before=None, capture_after=None):
    """The program as the backend pipeline holds it at one point (see CapturePass).

    `before`/`after` insert passes that should run first; the capture goes
    before `capture_before` or after `capture_after` (an upstream pass type).
    """
    import copy

    from etfold.harness.tosa_runner import lower_tosa

    capture = CapturePass()
    before = {k: list(v) for k, v in (before or {}).items()}
    after = {k: list(v) for k, v in (after or {}).items()}
    if capture_before is not None:
        before.setdefault(capture_before, []).append(capture)
    else:
        after.setdefault(capture_after, []).append(capture)
    with arm_pass_insertions(before, after):
        lower_until_probe(lower_tosa, copy.deepcopy(program))
    return capture.snapshot


def run_pass_on(snapshot, pass_instance, mutate=None, profile: str | None = None):
    """Run `pass_instance` on a copy of `snapshot` after `mutate(graph_module, program)`,
    inside the TOSA lowering context the backend pipeline provides.

    Returns (code before the pass, code after it, the program).
    """
    import copy

    from executorch.backends.arm.tosa.specification import (
        TosaLoweringContext,
        TosaSpecification,
    )
    from torch._export.utils import _get_shape_env_from_gm

    from etfold.harness.tosa_runner import INT

    program = copy.deepcopy(snapshot)
    spec = TosaSpecification.create_from_string(profile or INT)
    with TosaLoweringContext(spec, _get_shape_env_from_gm(program.graph_module)):
        return _run_pass(program, pass_instance, mutate)


def _run_pass(program, pass_instance, mutate):
    graph_module = program.graph_module
    if mutate is not None:
        mutate(graph_module, program)
    graph_module.recompile()
    before = graph_module.code
    pass_instance.exported_program = program
    result = pass_instance(graph_module)
    if result.modified:  # as ArmPassManager's adapter does
        program._graph_module = result.graph_module
    return before, result.graph_module.code, program


class ProbeStop(Exception):
    """Raised by CapturePass once it has run: the lowering stops there by design."""


def lower_until_probe(lower, program) -> None:
    """Call `lower(program)`, expecting a CapturePass to stop it; re-raise anything else."""
    try:
        lower(program)
    except Exception as error:  # the pass manager wraps the ProbeStop
        cause: BaseException | None = error
        while cause is not None and not isinstance(cause, ProbeStop):
            cause = cause.__cause__
        if cause is None:
            raise
        return
    raise AssertionError("the lowering finished: the probe pass never ran")
