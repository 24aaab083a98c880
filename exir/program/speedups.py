# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The lowering speed-ups: on by default, switchable, and off with one warning when unsure.

`torch_speedups()` enters every patch of `TORCH_PATCHES` (torch's lowering work
minus repeats; each module says what it skips and why the result is the same)
and those backends registered (`register_speedup`), then lazy graph modules.
The patches act only in the context that entered the scope, and restore torch
when the last scope anywhere closes.

They are written against the versions in `TESTED_VERSIONS`. On any other
version, or when an attribute a patch replaces is gone, none of them is
entered, a `SpeedupsOffWarning` says why (once per reason and process) and the
lowering runs on stock torch. `ETFOLD_SPEEDUPS=0` in the environment turns them
off; `ETFOLD_SPEEDUPS=etfold` keeps them for etfold's lowerings and off for the
stock lowerings the harness runs beside them (`stock_lowerings_unpatched`: the
test suite's setting, so every stock baseline is unpatched); an explicit
`enabled=` argument wins over the environment.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import threading
import warnings
from collections.abc import Iterator

from etfold.exir.program.composite_op_lookup import PATCH as COMPOSITE_OP_LOOKUP
from etfold.exir.program.edge_dtype_check_once import PATCH as EDGE_DTYPE_CHECK_ONCE
from etfold.exir.program.lazy_graph_modules import (
    PATCH as LAZY_GRAPH_MODULES,
)
from etfold.exir.program.lazy_graph_modules import (
    code_on_first_use_for_graph_modules,
)
from etfold.exir.program.py_kernel_closures import PATCH as PY_KERNEL_CLOSURES
from etfold.exir.program.reentrant_patch import PatchUnavailable, ReentrantPatch
from etfold.exir.program.shared_provenance import PATCH as SHARED_PROVENANCE
from etfold.versions import tested_releases

ENVIRONMENT_SWITCH = "ETFOLD_SPEEDUPS"
ETFOLD_LOWERINGS_ONLY = "etfold"  # the switch's value that leaves stock lowerings unpatched

# distribution -> the versions the patches were written and tested against (etfold.versions)
TESTED_VERSIONS: dict[str, tuple[str, ...]] = tested_releases()

TORCH_PATCHES: tuple[ReentrantPatch, ...] = (
    COMPOSITE_OP_LOOKUP,
    PY_KERNEL_CLOSURES,
    SHARED_PROVENANCE,
    EDGE_DTYPE_CHECK_ONCE,
)


class SpeedupsOffWarning(UserWarning):
    """The lowering speed-ups are off for a reason the user did not choose."""


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _release(distribution: str) -> str:
    version = importlib.metadata.version(distribution)
    return version.split("+", 1)[0]


def untested_versions() -> list[str]:
    """`name version` for each distribution whose installed version was not tested."""
    found = []
    for distribution, tested in TESTED_VERSIONS.items():
        try:
            release = _release(distribution)
        except importlib.metadata.PackageNotFoundError:
            release = "not installed"
        if release not in tested:
            found.append(f"{distribution} {release} (tested: {', '.join(tested)})")
    return found


def why_unavailable(patches: tuple[ReentrantPatch, ...]) -> str | None:
    """Why the speed-ups cannot be trusted here, or None."""
    untested = untested_versions()
    if untested:
        return f"untested versions: {'; '.join(untested)}"
    for patch in patches:
        try:
            patch.check()
        except PatchUnavailable as reason:
            return f"{patch.name}: {reason}"
    return None


def _warn_once(reason: str) -> None:
    with _warned_lock:
        if reason in _warned:
            return
        _warned.add(reason)
    warnings.warn(
        f"etfold's lowering speed-ups are off ({reason}); lowering runs on stock torch",
        SpeedupsOffWarning,
        stacklevel=4,
    )


def stock_lowerings_unpatched() -> bool:
    """The environment switch keeps the speed-ups out of stock lowerings (`etfold`)."""
    return os.environ.get(ENVIRONMENT_SWITCH, "").strip().lower() == ETFOLD_LOWERINGS_ONLY


def speedups_enabled(enabled: bool | None = None) -> bool:
    """`enabled` when given, else the environment switch (on unless it says 0/false/off/no)."""
    if enabled is not None:
        return bool(enabled)
    return os.environ.get(ENVIRONMENT_SWITCH, "1").strip().lower() not in (
        "0",
        "false",
        "off",
        "no",
    )


@contextlib.contextmanager
def patches_if_sound(
    patches: tuple[ReentrantPatch, ...], enabled: bool | None = None
) -> Iterator[bool]:
    """Every patch entered when switched on and sound here; none otherwise (with one warning
    when that was not the user's choice). Yields whether they are on."""
    if not speedups_enabled(enabled):
        yield False
        return
    reason = why_unavailable(patches)
    if reason is not None:
        _warn_once(reason)
        yield False
        return
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch.scope())
        yield True


_registered: list[ReentrantPatch] = []


def register_speedup(patch: ReentrantPatch) -> None:
    """A backend's speed-up, entered with torch's (registering twice is one registration)."""
    if patch not in _registered:
        _registered.append(patch)


def registered_speedups() -> tuple[ReentrantPatch, ...]:
    return tuple(_registered)


def every_speedup() -> tuple[ReentrantPatch, ...]:
    """Torch's patches, those backends registered, and lazy graph modules."""
    return (*TORCH_PATCHES, *_registered, LAZY_GRAPH_MODULES)


def active_speedups() -> list[str]:
    """The names of the speed-ups acting in this context (none outside a lowering)."""
    return [patch.name for patch in every_speedup() if patch.active()]


@contextlib.contextmanager
def torch_speedups(enabled: bool | None = None) -> Iterator[None]:
    """Torch's own lowering work, minus repeats: one composite-op lookup per walk, one kernel
    registration closure per op and key, provenance chains shared instead of deep-copied,
    the edge verifier's dtype check once per graph, and a graph module's Python code written
    once, when the scope exits, rather than at every build and pass; and each speed-up a
    backend registered (`register_speedup`).

    Programs come out byte-identical; torch is as it was once the scope exits.
    """
    with patches_if_sound(every_speedup(), enabled) as on:
        if not on:
            yield
            return
        with code_on_first_use_for_graph_modules():
            yield
