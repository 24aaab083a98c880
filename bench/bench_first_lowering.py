# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The first XNNPACK lowering in a fresh process: stock, and etfold's with and without speed-ups.

    .venv/bin/python bench/bench_first_lowering.py [--pairs N]

A process's first lowering pays for work later ones reuse (upstream's XNNPACK
preprocess exports its SDPA and bilinear-upsample match patterns on first use;
inside the speed-ups they are built only for a graph holding their op). Each
round runs three sides in fresh processes back to back, rotating which goes
first: `stock` (upstream's entry point and partitioner), `etfold-su` and
`etfold+su` (etfold's, `speedups=False` / `True`). Each process imports
everything, then times its first lowering to a program buffer (imports
excluded). Prints per model the median seconds of each side and, per round,
etfold+su / etfold-su and etfold-su / stock: median (p10-p90). The conv-only
model builds no patterns with the speed-ups; the attention block builds the
SDPA ones on every side.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

_PROBE = """
import sys, time, torch
import functools
model, side = sys.argv[1], sys.argv[2]
if side == "stock":
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
else:
    from etfold.backends.xnnpack import XnnpackPartitioner
    from etfold.exir import to_edge_transform_and_lower as lower
    to_edge_transform_and_lower = functools.partial(lower, speedups=side == "etfold+su")

from etfold.harness.bench_models import first_lowering_model

module, inputs = first_lowering_model(model)
program = torch.export.export(module.eval(), inputs)
start = time.perf_counter()
to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer
print(time.perf_counter() - start)
"""

MODELS = ("conv", "attention")
SIDES = ("stock", "etfold-su", "etfold+su")
# (numerator, denominator) of each ratio printed
RATIOS = (("etfold+su", "etfold-su"), ("etfold-su", "stock"))


def _first_lowering_s(model: str, side: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, model, side], capture_output=True, text=True, check=True
    )
    return float(done.stdout.strip().splitlines()[-1])


def _spread(values: list[float]) -> tuple[float, float, float]:
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return statistics.median(values), deciles[0], deciles[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=5, help="rounds per model (>= 2)")
    rounds = max(2, parser.parse_args().pairs)
    heads = "".join(f" {side + ' s':>12s}" for side in SIDES)
    print(f"{'model':10s}{heads}  " + "  ".join(f"{a}/{b}" for a, b in RATIOS))
    for model in MODELS:
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        for index in range(rounds):
            for side in SIDES[index % 3 :] + SIDES[: index % 3]:
                times[side].append(_first_lowering_s(model, side))
        cells = []
        for a, b in RATIOS:
            ratio, low, high = _spread([x / y for x, y in zip(times[a], times[b], strict=True)])
            cells.append(f"{ratio:.2f}x ({low:.2f}-{high:.2f})")
        medians = "".join(f" {statistics.median(times[side]):12.2f}" for side in SIDES)
        print(f"{model:10s}{medians}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
