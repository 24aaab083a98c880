# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Any lowering, upstream's entry point included, without the work torch and XNNPACK repeat.

`etfold report` lowers every model twice (stock and etfold) and enters
`lowering_speedups()` around all of it, as etfold's entry point does around its
own call: torch skips repeated lookups and builds no Python code nobody runs
(`torch_speedups`), and upstream's XNNPACK passes build their match patterns
only for a graph holding their op (`patterns_on_demand`, registered by
`etfold.backends.xnnpack`). Programs come out byte for byte as without it, so a
stock row stays stock; the report times the runtime, never the lowering. The
patches act in this thread only, and torch and ExecuTorch are as they were on
exit. `enabled` and `ETFOLD_SPEEDUPS` switch them as for the entry point.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def lowering_speedups(enabled: bool | None = None) -> Iterator[None]:
    import etfold.backends.xnnpack  # noqa: F401  (registers its speed-up)
    from etfold.exir.program.speedups import torch_speedups

    with torch_speedups(enabled):
        yield
