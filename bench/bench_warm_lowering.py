# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A warm XNNPACK lowering with and without etfold's lowering speed-ups, for both entry points.

    .venv/bin/python bench/bench_warm_lowering.py [--budget SECONDS] [--rounds N]

Four flavours per model, timed interleaved in one process after warm-up
(`etfold.harness.timing`), each lowering an exported program to a program
buffer: `stock` is upstream's entry point and partitioner; `stock+su` is the
same call inside `lowering_speedups(True)` (the scope `etfold report` enters;
its bytes must equal stock's, checked here); `etfold-su` and `etfold+su` are
etfold's entry point and partitioner (which also run etfold's folds) with
`speedups=False` and `speedups=True` (their bytes must be equal too). Prints
per flavour the median milliseconds per lowering, then the ratio with / without
speed-ups per round for each entry point: median (p10-p90).
"""

from __future__ import annotations

import argparse

import torch

from etfold.harness.bench_models import warm_lowering_models as _models


def _flavours(program):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
        XnnpackPartitioner as StockPartitioner,
    )
    from executorch.exir import to_edge_transform_and_lower as stock_lower

    from etfold.backends.xnnpack import XnnpackPartitioner
    from etfold.exir import to_edge_transform_and_lower
    from etfold.harness.lowering_speedups import lowering_speedups

    def stock():
        return stock_lower(program, partitioner=[StockPartitioner()]).to_executorch().buffer

    def stock_with_speedups():
        with lowering_speedups(True):
            return stock()

    def etfold(speedups: bool):
        lowered = to_edge_transform_and_lower(
            program, partitioner=[XnnpackPartitioner()], speedups=speedups
        )
        return lowered.to_executorch().buffer

    return {
        "stock": stock,
        "stock+su": stock_with_speedups,
        "etfold-su": lambda: etfold(False),
        "etfold+su": lambda: etfold(True),
    }


# (without, with) speed-ups, for each entry point
PAIRS = (("stock", "stock+su"), ("etfold-su", "etfold+su"))


def main() -> None:
    from etfold.harness.timing import time_interleaved

    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=30.0, help="seconds per model")
    parser.add_argument("--rounds", type=int, default=8, help="at least this many rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'model':10s} {'flavour':9s} {'ms':>7s}  with/without speed-ups median (p10-p90)")
    for name, (module, inputs) in _models().items():
        flavours = _flavours(torch.export.export(module, inputs))
        for without, with_ in PAIRS:
            if flavours[with_]() != flavours[without]():
                raise SystemExit(f"{name}: the speed-ups changed the program's bytes ({with_})")
        timing = time_interleaved(flavours, budget_s=args.budget, min_rounds=args.rounds, warmup=1)
        without = {with_: without for without, with_ in PAIRS}
        for flavour, spread in timing.milliseconds.items():
            ratio = timing.ratios.get((without.get(flavour), flavour))
            cell = f"{ratio.median:.2f}x ({ratio.p10:.2f}-{ratio.p90:.2f})" if ratio else ""
            print(f"{name:10s} {flavour:9s} {spread.median:7.0f}  {cell}")


if __name__ == "__main__":
    main()
