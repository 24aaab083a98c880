# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A scope that patches torch on first entry and restores it on last exit.

Lowering-speed scopes replace a torch internal with an equivalent that does less
work. Scopes nest and may be entered from several threads; the patch is
installed once while any entry is open and undone when the last one closes, so
torch is exactly as it was outside every scope.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class ReentrantPatch:
    """`install()` on the first open entry, `uninstall()` when the last one closes."""

    def __init__(self, install: Callable[[], None], uninstall: Callable[[], None]):
        self._install = install
        self._uninstall = uninstall
        self._lock = threading.RLock()
        self._depth = 0

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._install()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._uninstall()
