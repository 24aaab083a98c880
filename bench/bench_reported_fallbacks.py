# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The fallbacks ExecuTorch users reported upstream, as small modules: stock vs etfold.

    .venv/bin/python bench/bench_reported_fallbacks.py [--budget SECONDS] [--rows NAME ...]

Each row of `etfold.harness.bench_models.REPORTED_FALLBACKS` (random weights, seeded):
Whisper-style tied logits after a layer norm (tiny, and a 8192 x 384 table), a ViT
tail (`where` leaky ReLU, CLS token, token mean), GPT-2's `gelu_new` MLP, a
MobileNetV3 block, a reshape to heads with batch and length both dynamic, an fp16
conv + SiLU. Stock: upstream's `XnnpackPartitioner` through upstream's entry point;
etfold: etfold's, lowered and planned inside `declared_bounds_kept()`.

Columns: delegates / ops outside, the ops left outside, max |error| against eager,
median ms per call (one thread), and etfold's time over stock's as the median
(p10-p90) of per-round ratios, timed interleaved in one process (below 1: faster).
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as StockPartitioner,
)
from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.bench_models import REPORTED_FALLBACKS
from etfold.harness.timing import time_interleaved
from etfold.harness.xnnpack_runner import eager_outputs, lower_xnnpack, max_abs_error


def lowered(name: str) -> tuple[dict, tuple, list]:
    build, shapes = REPORTED_FALLBACKS[name]
    module, inputs = build()

    def export():
        return torch.export.export(module, inputs, dynamic_shapes=shapes() if shapes else None)

    programs = {
        "stock": lower_xnnpack(export(), [StockPartitioner()]),
        "etfold": lower_xnnpack(
            export(),
            [XnnpackPartitioner()],
            lower=to_edge_transform_and_lower,
            keep_declared_bounds=True,
        ),
    }
    return programs, inputs, eager_outputs(module, inputs)


def _outside(program) -> str:
    ops = Counter({str(op).removeprefix("aten."): n for op, n in program.ops_outside().items()})
    return ", ".join(f"{op} x{n}" for op, n in sorted(ops.items())) or "none"


def row(name: str, budget: float) -> None:
    programs, inputs, expected = lowered(name)
    timing = time_interleaved(
        {flavour: (lambda p=p: p.run(*inputs)) for flavour, p in programs.items()},
        budget_s=budget,
        min_rounds=20,
    )
    ratio = timing.ratios[("stock", "etfold")]
    print(f"{name}: etfold/stock {ratio.median:.3f} ({ratio.p10:.3f}-{ratio.p90:.3f})")
    for flavour, program in programs.items():
        error = max_abs_error(program.run(*inputs), expected)
        print(
            f"  {flavour:6} {program.delegates()} / {sum(program.ops_outside().values())}"
            f"  {timing.milliseconds[flavour].median:.4f} ms  err {error:.1e}"
            f"  outside: {_outside(program)}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=4.0, help="seconds of timing per row")
    parser.add_argument("--rows", nargs="*", default=list(REPORTED_FALLBACKS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    _unsafe_reset_threadpool(1)
    for name in args.rows:
        row(name, args.budget)


if __name__ == "__main__":
    main()
