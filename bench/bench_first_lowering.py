# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The first XNNPACK lowering in a fresh process: upstream's entry point and partitioner vs etfold's.

    .venv/bin/python bench/bench_first_lowering.py [--pairs N]

A process's first lowering pays for work later ones reuse (upstream's XNNPACK
preprocess exports its SDPA and bilinear-upsample match patterns on first use;
etfold builds them only for a graph holding their op). Each pair runs stock
and etfold in two fresh processes back to back, alternating which goes first;
each process imports everything, then times its first lowering to a program
buffer (imports excluded). Prints per model the median seconds of each side
and the etfold/stock ratio per pair: median (p10-p90). The conv-only model
builds no patterns under etfold; the attention block builds the SDPA ones on
both sides, and gains only the bilinear ones and torch's repeated work.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

_PROBE = """
import sys, time, torch
model, side = sys.argv[1], sys.argv[2]
if side == "stock":
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
else:
    from etfold.backends.xnnpack import XnnpackPartitioner
    from etfold.exir import to_edge_transform_and_lower

class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return torch.softmax(q @ k.transpose(-1, -2) / 32**0.5, -1) @ v

torch.manual_seed(0)
if model == "conv":
    module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3)
    )
    inputs = (torch.randn(1, 3, 16, 16),)
else:
    module, inputs = Attention(), (torch.randn(1, 8, 32),)
program = torch.export.export(module.eval(), inputs)
start = time.perf_counter()
to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer
print(time.perf_counter() - start)
"""

MODELS = ("conv", "attention")


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
    parser.add_argument("--pairs", type=int, default=5, help="stock/etfold pairs per model (>= 2)")
    pairs = max(2, parser.parse_args().pairs)
    print(f"{'model':10s} {'stock s':>8s} {'etfold s':>9s}  etfold/stock median (p10-p90)")
    for model in MODELS:
        times = {"stock": [], "etfold": []}
        for index in range(pairs):
            order = ("stock", "etfold") if index % 2 == 0 else ("etfold", "stock")
            for side in order:
                times[side].append(_first_lowering_s(model, side))
        ratio, low, high = _spread(
            [e / s for e, s in zip(times["etfold"], times["stock"], strict=True)]
        )
        print(
            f"{model:10s} {statistics.median(times['stock']):8.2f} "
            f"{statistics.median(times['etfold']):9.2f}  {ratio:.2f}x ({low:.2f}-{high:.2f})"
        )


if __name__ == "__main__":
    main()
