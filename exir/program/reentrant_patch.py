# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A patch of torch or ExecuTorch that acts only for the context that entered it.

Where upstream has no hook, etfold replaces an attribute for the duration of a
scope. The replacement is installed on the first entry from any thread and
restored on the last exit, but it is gated: it runs etfold's version only in a
context (thread, or asyncio task) that is inside the scope, and upstream's
original everywhere else. So a `make_fx` or `torch.compile` in another thread,
while one thread lowers, runs stock torch.

Every replacement is built from the original it stands in for (`Replacement`)
and restored from the one record written at install; when an attribute is not
there, the patch refuses with `PatchUnavailable` before touching anything.

Why the swap itself is process-wide: a module or class attribute has one value for
every thread, and torch calls these functions through that attribute, so no
narrower install exists. The gate is what narrows it: while installed, the
attribute's value in any other context is a call straight to the original, with the
same arguments. Callers keep each scope to the one call that needs it (a lowering,
never an export or a quantizer).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass


class PatchUnavailable(RuntimeError):
    """The attribute a patch replaces is gone or not the kind it was written for."""


@dataclass(frozen=True)
class Replacement:
    """`owner.attribute` replaced by `make(original)`.

    The original is read from the owner's own `__dict__`, as stored (a
    staticmethod stays one). With `gated=True` (the default) the installed value
    calls `make(original)` only inside the scope, the original outside; a
    replacement that is not a function (a descriptor) gates itself with
    `ReentrantPatch.active()` and says `gated=False`.
    """

    owner: object
    attribute: str
    make: Callable
    gated: bool = True


@dataclass(frozen=True)
class _Installed:
    owner: object
    attribute: str
    original: object


def _stored(owner: object, attribute: str) -> object:
    try:
        return vars(owner)[attribute]
    except (KeyError, TypeError):
        name = getattr(owner, "__name__", type(owner).__name__)
        raise PatchUnavailable(f"{name}.{attribute} is gone") from None


def _gate(active: Callable[[], bool], original: Callable, replacement: Callable) -> Callable:
    @functools.wraps(original)
    def gate(*args, **kwargs):
        return (replacement if active() else original)(*args, **kwargs)

    return gate


GATE_CODE = _gate(bool, bool, bool).__code__  # a replacement reading its caller's frame skips it


class ReentrantPatch:
    """Replacements installed on the first open scope, restored when the last one closes,
    and in effect only in the contexts that are inside a scope."""

    def __init__(
        self,
        name: str,
        replacements: Callable[[], list[Replacement]],
        forget: Callable[[], None] | None = None,
    ):
        """`replacements()` lists what to replace (raising `PatchUnavailable` when it cannot
        say); `forget()` drops whatever the replacements remembered, once restored."""
        self.name = name
        self._replacements = replacements
        self._forget = forget
        self._lock = threading.RLock()
        self._depth = 0
        self._installed: list[_Installed] = []
        self._entered = contextvars.ContextVar(f"etfold_patch_{name}", default=0)

    def active(self) -> bool:
        """This context is inside a scope of the patch."""
        return self._entered.get() > 0

    def check(self) -> None:
        """Raise `PatchUnavailable` unless every attribute the patch replaces is there.
        Installed (a scope open anywhere), the attributes are the patch's own, checked
        when it installed: a nested scope is sound."""
        with self._lock:
            if self._depth > 0:
                return
        for replacement in self._replacements():
            self._checked_original(replacement)

    def _checked_original(self, replacement: Replacement) -> object:
        original = _stored(replacement.owner, replacement.attribute)
        function = original.__func__ if isinstance(original, staticmethod) else original
        if replacement.gated and not callable(function):
            raise PatchUnavailable(f"{replacement.attribute} is no longer callable")
        return original

    def _install(self) -> None:
        planned = [(r, self._checked_original(r)) for r in self._replacements()]
        # every value is built before the first attribute is set: a `make` that raises
        # leaves upstream untouched and no record behind
        values = [self._value(replacement, original) for replacement, original in planned]
        for (replacement, original), value in zip(planned, values, strict=True):
            self._installed.append(_Installed(replacement.owner, replacement.attribute, original))
            setattr(replacement.owner, replacement.attribute, value)

    def _value(self, replacement: Replacement, original: object) -> object:
        if not replacement.gated:
            return replacement.make(original)
        if isinstance(original, staticmethod):
            inner = original.__func__
            return staticmethod(_gate(self.active, inner, replacement.make(inner)))
        return _gate(self.active, original, replacement.make(original))

    def _uninstall(self) -> None:
        while self._installed:
            record = self._installed.pop()
            setattr(record.owner, record.attribute, record.original)
        if self._forget is not None:
            self._forget()

    def original(self, owner: object, attribute: str) -> object:
        """Upstream's value of `owner.attribute`, also while the patch is installed."""
        for record in self._installed:
            if record.owner is owner and record.attribute == attribute:
                return record.original
        return vars(owner)[attribute]

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Install on the first entry anywhere; act for this context until it exits."""
        with self._lock:
            if self._depth == 0:
                self._install()
            self._depth += 1
        token = self._entered.set(self._entered.get() + 1)
        try:
            yield
        finally:
            self._entered.reset(token)
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._uninstall()
