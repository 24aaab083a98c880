# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Attention under each kind of mask users give SDPA: stock vs etfold, in one process.

    .venv/bin/python bench/bench_attention_masks.py [--budget SECONDS] [--kinds K ...]

`etfold.harness.masked_attention.MaskedAttention` (separate q, k, v projections of
width 32, 4 heads) with a [1, 1, T, T] mask of each kind (a `tril` of the length, a
GPT-2-style boolean buffer sliced, additive -inf and finfo.min masks, `is_causal`, a
runtime boolean or additive mask), batch 2, exported static (T = 16) and with a
dynamic T (2..23, run at 16), random inputs, one thread: the registry's
`masked_attention_<kind>_static` / `_dynamic` (`etfold.harness.bench_models`).

Stock: upstream `XnnpackPartitioner` through upstream's entry point. etfold: etfold's
partitioner and entry point. Columns: delegates / ops outside, median ms per call, and
etfold's ratio to stock as the median (p10-p90) of per-round ratios (below 1: faster).
Outputs are checked against eager within fp32 tolerance.
"""

from __future__ import annotations

import argparse

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.bench_models import bench_model, shaped
from etfold.harness.masked_attention import MASKS
from etfold.harness.timing import time_interleaved
from etfold.harness.xnnpack_runner import assert_close, eager_outputs, lower_xnnpack


def lowered(module: torch.nn.Module, inputs: tuple, dynamic_shapes) -> dict:
    def export():
        return torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes)

    return {
        "stock": lower_xnnpack(export(), [UpstreamXnnpackPartitioner()]),
        "etfold": lower_xnnpack(
            export(), [XnnpackPartitioner()], lower=to_edge_transform_and_lower
        ),
    }


def row(kind: str, dynamic: bool, budget: float) -> None:
    model = bench_model(shaped(f"masked_attention_{kind}", dynamic))
    module, inputs = model.build()
    programs = lowered(module, inputs, model.dynamic_shapes() if dynamic else None)
    expected = eager_outputs(module, inputs)
    for program in programs.values():
        assert_close(program.run(*inputs), expected, atol=1e-5)
    timing = time_interleaved(
        {name: (lambda p=p: p.run(*inputs)) for name, p in programs.items()},
        budget_s=budget,
        min_rounds=20,
    )
    ratio = timing.ratios[("stock", "etfold")]
    cells = []
    for name, program in programs.items():
        outside = sum(program.ops_outside().values())
        ms = timing.milliseconds[name].median
        cells.append(f"{name} {program.delegates()} / {outside}: {ms:.4f} ms")
    shape = "dynamic" if dynamic else "static"
    print(
        f"{kind:16} {shape:8} {' | '.join(cells)}; "
        f"/stock {ratio.median:.3f} ({ratio.p10:.3f}-{ratio.p90:.3f})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=4.0, help="seconds of timing per row")
    parser.add_argument("--kinds", nargs="*", default=[k for k in MASKS if k != "finfo_min"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    _unsafe_reset_threadpool(1)
    for kind in args.kinds:
        for dynamic in (False, True):
            row(kind, dynamic, args.budget)


if __name__ == "__main__":
    main()
