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
