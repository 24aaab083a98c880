# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Fold decisions: what a matcher declined and why, what a rewrite applied.

Every pass reports through here, so the same record reaches the log and
`etfold report` (through `collect_decisions`).

Logging: each fold logs at INFO on its own logger, `etfold.<fold id>` (the fold
`xnnpack.fold_gemm_weight` logs on `etfold.xnnpack.fold_gemm_weight`), so one
fold can be shown or silenced alone. ExecuTorch calls `logging.basicConfig` on
import, which makes a later `basicConfig(level=INFO)` in user code a no-op;
`set_log_level("INFO")` shows the decisions regardless.

Collection is context-local (a `contextvars.ContextVar`): a `collect_decisions()`
block sees what its own thread (or asyncio task) records, never another's.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TextIO

ROOT_LOGGER = "etfold"
logger = logging.getLogger(ROOT_LOGGER)


@dataclass(frozen=True)
class Declined:
    """A matcher's answer when a fold must not fire; `reason` is user-facing."""

    reason: str

    def __bool__(self) -> bool:  # a Declined is never a match
        return False


def first_declined(*checks: Callable[[], Declined | None]) -> Declined | None:
    """The first check's decline, in order (later checks may assume earlier ones held)."""
    for check in checks:
        if (declined := check()) is not None:
            return declined
    return None


@dataclass(frozen=True)
class FoldDecision:
    fold: str
    applied: bool
    where: str
    detail: str


_collectors: contextvars.ContextVar[tuple[list[FoldDecision], ...]] = contextvars.ContextVar(
    "etfold_decision_collectors", default=()
)


def fold_logger(fold: str) -> logging.Logger:
    """The logger a fold's decisions go to: `etfold.<fold id>`."""
    return logging.getLogger(f"{ROOT_LOGGER}.{fold}")


def _record(decision: FoldDecision, level: int = logging.INFO) -> None:
    verb = "applied" if decision.applied else "declined"
    fold_logger(decision.fold).log(
        level, "%s %s at %s: %s", decision.fold, verb, decision.where, decision.detail
    )
    for collector in _collectors.get():
        collector.append(decision)


def record_applied(fold: str, where: str, detail: str = "") -> None:
    _record(FoldDecision(fold, True, where, detail))


def record_declined(fold: str, where: str, reason: str, *, level: int = logging.INFO) -> None:
    """`level=logging.WARNING` for declines that cost the user (work left on portable kernels)."""
    _record(FoldDecision(fold, False, where, reason), level)


@contextlib.contextmanager
def collect_decisions() -> Iterator[list[FoldDecision]]:
    """Collect every decision recorded inside the block, in this context only.

    Blocks nest (an outer block also sees what an inner one collects); another
    thread's decisions never reach this block.
    """
    collected: list[FoldDecision] = []
    token = _collectors.set((*_collectors.get(), collected))
    try:
        yield collected
    finally:
        _collectors.reset(token)


class _DecisionHandler(logging.StreamHandler):
    """The handler `set_log_level` attaches (recognised by type, so it is attached once)."""


def set_log_level(level: int | str | None = "INFO", stream: TextIO | None = None) -> None:
    """Show fold decisions at `level` and above on `stream` (stderr by default).

    Attaches one handler to the `etfold` logger and stops its records from also
    reaching the root logger's handlers (no duplicate lines). `None` removes
    the handler and restores propagation to the root logger.
    """
    for handler in [h for h in logger.handlers if isinstance(h, _DecisionHandler)]:
        logger.removeHandler(handler)
    if level is None:
        logger.setLevel(logging.NOTSET)
        logger.propagate = True
        return
    handler = _DecisionHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
