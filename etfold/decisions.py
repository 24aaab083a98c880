"""Fold decisions: what a matcher declined and why, what a rewrite applied.

Every pass reports through here, so the same record reaches the log (INFO) and
`etfold report` (through `collect_decisions`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

logger = logging.getLogger("etfold")


@dataclass(frozen=True)
class Declined:
    """A matcher's answer when a fold must not fire; `reason` is user-facing."""

    reason: str

    def __bool__(self) -> bool:  # a Declined is never a match
        return False


@dataclass(frozen=True)
class FoldDecision:
    fold: str
    applied: bool
    where: str
    detail: str


_collectors: list[list[FoldDecision]] = []


def _record(decision: FoldDecision, level: int = logging.INFO) -> None:
    verb = "applied" if decision.applied else "declined"
    logger.log(level, "%s %s at %s: %s", decision.fold, verb, decision.where, decision.detail)
    for collector in _collectors:
        collector.append(decision)


def record_applied(fold: str, where: str, detail: str = "") -> None:
    _record(FoldDecision(fold, True, where, detail))


def record_declined(fold: str, where: str, reason: str, *, level: int = logging.INFO) -> None:
    """`level=logging.WARNING` for declines that cost the user (work left on portable kernels)."""
    _record(FoldDecision(fold, False, where, reason), level)


@contextlib.contextmanager
def collect_decisions() -> Iterator[list[FoldDecision]]:
    """Collect every decision recorded inside the block (nesting allowed)."""
    collected: list[FoldDecision] = []
    _collectors.append(collected)
    try:
        yield collected
    finally:
        # by identity: two collectors holding equal records must not be confused
        _collectors[:] = [c for c in _collectors if c is not collected]
