# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Any lowering, upstream's entry point included, without the work torch and XNNPACK repeat.

`etfold report` lowers every model twice (stock and etfold) and the suite lowers
hundreds of programs; both enter `lowering_speedups()` around all of it, as
etfold's entry point does around its own call. Inside, torch skips repeated
lookups (`torch_speedups`), upstream's XNNPACK passes build their match
patterns only for a graph holding their op (`patterns_on_demand`) and its
partitioner tells its caller without reading source files
(`caller_checked_from_frames`). Programs come
out byte for byte as without it, so a stock row stays stock; the report times
the runtime, never the lowering. Torch and ExecuTorch are as they were on exit.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def lowering_speedups():
    from etfold.backends.xnnpack.partitioner_caller_check import caller_checked_from_frames
    from etfold.backends.xnnpack.pattern_graphs_on_demand import patterns_on_demand
    from etfold.exir.program.lower import torch_speedups

    with torch_speedups(), patterns_on_demand(), caller_checked_from_frames():
        yield
