# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Which workflow called XNNPACK's partitioner, told from the frames alone.

Upstream's `XnnpackPartitioner.partition` warns when it is reached through the
deprecated `to_edge(...).to_backend(...)` workflow. To tell, it calls
`inspect.stack()`, which reads the source file of every frame on the stack (2 %
of the suite's time), yet the verdict needs only each frame's function and file
name, which the frame's code object carries. `called_through_deprecated_to_backend`
gives upstream's verdict from those; etfold's partitioner asks it, and inside
`caller_checked_from_frames()` upstream's partitioner does too. The scope undoes
itself on exit; where upstream has no such check it changes nothing.
"""

from __future__ import annotations

import contextlib
import sys
from types import FrameType

from etfold.exir.program.reentrant_patch import ReentrantPatch

_CHECK = "_check_if_called_from_to_backend"
_saved: list = []


def called_through_deprecated_to_backend(frame: FrameType | None) -> bool:
    """Upstream's verdict for a stack whose innermost frame is `frame`: no
    `to_edge_transform_and_lower` on it, and a `to_backend` of ExecuTorch's program module."""
    codes = []
    while frame is not None:
        codes.append(frame.f_code)
        frame = frame.f_back
    if any(code.co_name == "to_edge_transform_and_lower" for code in codes):
        return False
    return any(
        code.co_name == "to_backend" and "program/_program.py" in code.co_filename for code in codes
    )


def _from_frames(self) -> bool:
    return called_through_deprecated_to_backend(sys._getframe(1))


def _upstream_class():
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return XnnpackPartitioner


def _install() -> None:
    upstream = _upstream_class()
    if _CHECK in vars(upstream):
        _saved.append(vars(upstream)[_CHECK])
        setattr(upstream, _CHECK, _from_frames)


def _uninstall() -> None:
    if _saved:
        setattr(_upstream_class(), _CHECK, _saved.pop())


_PATCH = ReentrantPatch(_install, _uninstall)


def upstreams_check():
    """Upstream's own check, also while the scope is entered (what the scope is compared against)."""
    return _saved[0] if _saved else vars(_upstream_class()).get(_CHECK)


def caller_checked_from_frames() -> contextlib.AbstractContextManager[None]:
    """While entered, upstream's XNNPACK partitioner tells its caller from the frames."""
    return _PATCH.scope()
