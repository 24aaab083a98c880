# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Which workflow called XNNPACK's partitioner: upstream's own verdict.

Upstream's `XnnpackPartitioner.partition` warns when it is reached through the
deprecated `to_edge(...).to_backend(...)` workflow; its
`_check_if_called_from_to_backend` tells from `inspect.stack()`. etfold once
gave the same verdict from frame names (skipping the source reads of
`inspect.stack()`, 2 % of the suite), which meant re-writing upstream's check:
that speed-up is dropped, and the verdict is upstream's check, called.
"""

from __future__ import annotations

from types import FrameType

_CHECK = "_check_if_called_from_to_backend"


def _upstream_class():
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return XnnpackPartitioner


def upstreams_check():
    """Upstream's check, unbound (it reads only the stack, never its partitioner)."""
    return vars(_upstream_class())[_CHECK]


def called_through_deprecated_to_backend(frame: FrameType | None = None) -> bool:
    """Upstream's verdict for the calling stack. `frame` is unused: upstream's check walks
    the whole stack, which holds the caller's frame."""
    return upstreams_check()(None)
