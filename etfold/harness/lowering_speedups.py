# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Any lowering, upstream's entry point included, without the work torch and XNNPACK repeat.

The harness's lowering calls (`xnnpack_runner.lower_xnnpack`, `tosa_runner.lower_tosa`,
`vela.lower_ethos_u`) and ExecuTorch's LLM export through `etfold.llm_export` enter
`lowering_speedups()` around each lowering call, as etfold's entry point does around
its own: torch skips repeated lookups and builds no Python code nobody runs
(`torch_speedups`), and upstream's XNNPACK passes build their match patterns only for
a graph holding their op (`patterns_on_demand`, registered by `etfold.backends.xnnpack`).
Never around an export, a quantizer or a calibration: torch.export and dynamo trace on
stock torch. Programs come out byte for byte as without it, so a stock row of
`etfold report` stays stock; the report times the runtime, never the lowering. The
patches act in this context only, and torch and ExecuTorch are as they were on exit.
`enabled` and `ETFOLD_SPEEDUPS` switch them as for the entry point; a caller lowering
with upstream alone says `stock=True`, and `ETFOLD_SPEEDUPS=etfold` leaves that
lowering unpatched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def lowering_speedups(enabled: bool | None = None, *, stock: bool = False) -> Iterator[None]:
    import etfold.backends.xnnpack  # noqa: F401  (registers its speed-up)
    from etfold.exir.program.speedups import stock_lowerings_unpatched, torch_speedups

    if enabled is None and stock and stock_lowerings_unpatched():
        enabled = False

    with torch_speedups(enabled):
        yield
