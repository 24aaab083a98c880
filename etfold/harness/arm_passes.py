"""Run extra passes inside ArmPassManager's backend pipeline for one block.

Tests use this to place a pass exactly where registration would, without
registering anything globally beyond the `with` block.
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
    from executorch.backends.arm._passes import arm_pass_manager as apm

    added: list[tuple[type, str, object]] = []
    try:
        for side, table in (("before", before or {}), ("after", after or {})):
            for target, passes in table.items():
                register = getattr(apm, f"register_pass_insertions_{side}")
                register(target, list(passes))
                added.extend((target, side, p) for p in passes)
        yield
    finally:
        for target, side, instance in added:
            insertions = apm._registered_pass_insertions.get(target)
            if insertions is None:
                continue
            bucket = insertions.before_passes if side == "before" else insertions.after_passes
            bucket[:] = [p for p in bucket if p is not instance]
            if not insertions.before_passes and not insertions.after_passes:
                del apm._registered_pass_insertions[target]


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


def _export_pass_base():
    from executorch.exir.pass_base import ExportPass

    return ExportPass


class ProbePass(_export_pass_base()):
    """Runs `inner` on the graph after `mutate(graph_module, exported_program)`.

    Records the generated code right before and after `inner`, then stops the
    lowering by raising `ProbeStop` (the rest of the pipeline need not accept
    the mutated graph). Use with `arm_pass_insertions` and catch the failure.
    """

    def __init__(self, inner, mutate=None):
        super().__init__()
        self.inner = inner
        self.mutate = mutate
        self.exported_program = None
        self.code_before: str | None = None
        self.code_after: str | None = None

    def call(self, graph_module):
        self.inner.exported_program = self.exported_program
        if self.mutate is not None:
            self.mutate(graph_module, self.exported_program)
        graph_module.recompile()
        self.code_before = graph_module.code
        result = self.inner(graph_module)
        self.code_after = result.graph_module.code
        raise ProbeStop


class ProbeStop(Exception):
    """Raised by ProbePass once it has run: the lowering stops there by design."""


def lower_until_probe(lower, program) -> None:
    """Call `lower(program)`, expecting a ProbePass to stop it; re-raise anything else."""
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
