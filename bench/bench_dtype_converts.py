# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Delegated fp32 <-> fp16/bf16 converts: stock ExecuTorch vs etfold, side by side in one process.

    .venv/bin/python bench/bench_dtype_converts.py [--runs N] [--models gemma3,llama] [--no-fold-weights]

Tiny Gemma3 (2 layers, hidden 256, vocab 1000) and tiny Llama (2 layers, hidden
128, vocab 1000), random weights, ids (1, 32), each in fp32, bf16 and fp16.
Stock: upstream `XnnpackPartitioner(enable_bf16=True)`. etfold: etfold's
`XnnpackPartitioner(enable_bf16=True)` through `etfold.exir.to_edge_transform_and_lower`
(constant folding on; `--no-fold-weights` measures the convert delegation alone).
The runtime and torch run single-threaded.

Columns: delegates; float converts left outside delegates, split into converts of
activations and converts of constants (no user input reaches them: cast buffers,
masks and rotary tables computed from constants, which etfold folds at export);
all ops outside (memory-planning `alloc` not counted) and their etfold/stock ratio;
latency etfold/stock as the median (p10-p90) of per-pair ratios of back-to-back
runs on the XNNPACK runtime; etfold's bf16/fp16 program against stock's fp32 one,
paired the same way; max error against eager in the same dtype. Targets, checked
per row: ops outside and latency etfold/stock <= 1; on bf16/fp16 rows, delegates
<= the fp32 program's and zero activation converts outside.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.dtype_convert_match import float_converts_outside_delegates
from etfold.demo_models.mixed_precision_decoders import tiny_gemma3, tiny_llama, token_ids
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.xnnpack_runner import (
    XnnpackProgram,
    eager_outputs,
    export_method,
    lower_xnnpack,
    max_abs_error,
)

MODELS = {"gemma3": tiny_gemma3, "llama": tiny_llama}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Row:
    delegates: int
    activation_converts: int
    constant_converts: int
    ops_outside: Counter
    error: float
    program: XnnpackProgram
    median_ms: float = float("nan")


def _lower(flavour: str, module, ids, fold_weights: bool) -> Row:
    program = export_method(module, "forward", (ids,))
    if flavour == "stock":
        lowered = lower_xnnpack(program, [UpstreamXnnpackPartitioner(enable_bf16=True)])
    else:
        partitioner = XnnpackPartitioner(enable_bf16=True, fold_weights=fold_weights)
        lowered = lower_xnnpack(program, [partitioner], lower=to_edge_transform_and_lower)
    converts = float_converts_outside_delegates(lowered.edge.exported_program())
    outside = Counter({op: n for op, n in lowered.ops_outside().items() if op != "alloc"})
    error = max_abs_error(lowered.run(ids), eager_outputs(module, (ids,)))
    return Row(
        lowered.delegates(), converts["activation"], converts["constant"], outside, error, lowered
    )


def _paired_ratios(base: Row, other: Row, ids, runs: int) -> list[float]:
    """Per-pair ratios other / base of back-to-back runs, in alternating order, so load
    from other processes on the machine hits both sides of a ratio alike."""
    base.program.run(ids)  # warm-up
    other.program.run(ids)
    samples: dict[int, list[float]] = {id(base): [], id(other): []}
    ratios = []
    for i in range(runs):
        pair = (base, other) if i % 2 == 0 else (other, base)
        for row in pair:
            start = time.perf_counter()
            row.program.run(ids)
            samples[id(row)].append((time.perf_counter() - start) * 1e3)
        ratios.append(samples[id(other)][-1] / samples[id(base)][-1])
    base.median_ms = statistics.median(samples[id(base)])
    other.median_ms = statistics.median(samples[id(other)])
    return ratios


def _spread(ratios: list[float]) -> str:
    """Median and p10-p90 of paired ratios."""
    deciles = statistics.quantiles(ratios, n=10)
    return f"{statistics.median(ratios):4.2f} ({deciles[0]:.2f}-{deciles[-1]:.2f})"


def _extra_ops(row: Row, fp32: Row) -> str:
    extra = {
        op.removeprefix("aten.").removesuffix(".out"): n - fp32.ops_outside.get(op, 0)
        for op, n in row.ops_outside.items()
        if n > fp32.ops_outside.get(op, 0)
        and "to_dim_order_copy" not in op
        and "_to_copy" not in op
    }
    return ", ".join(f"{op} x{n}" for op, n in sorted(extra.items())) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument(
        "--no-fold-weights", action="store_true", help="measure the convert delegation alone"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    _unsafe_reset_threadpool(1)  # single-threaded runtime: ratios independent of core count

    ids = token_ids()
    header = (
        f"{'model':7} {'dtype':5} | {'delegates':>11} | {'act conv out':>12} | "
        f"{'const conv out':>14} | {'ops outside':>11} | {'outside':>7} | "
        f"{'latency etfold/stock':>20} | {'etfold/fp32-stock':>17} | {'max err':>17} | targets"
    )
    print("stock / etfold in each column; ratios are etfold / stock: ops outside, and the median")
    print("(p10-p90) of paired back-to-back run times; etfold/fp32-stock pairs etfold's bf16/fp16")
    print("program with stock's fp32 program (information: CPUs without native bf16/fp16 differ)")
    print(header)
    print("-" * len(header))
    misses = 0
    for model_name in args.models.split(","):
        build = MODELS[model_name]
        fp32_stock = None
        for dtype_name, dtype in DTYPES.items():
            rows = {
                flavour: _lower(flavour, build(dtype), ids, not args.no_fold_weights)
                for flavour in ("stock", "etfold")
            }
            stock, ours = rows["stock"], rows["etfold"]
            latency = _paired_ratios(stock, ours, ids, args.runs)
            stock_outside, ours_outside = (sum(r.ops_outside.values()) for r in (stock, ours))
            outside_ratio = ours_outside / stock_outside if stock_outside else 1.0
            if dtype == torch.float32:
                fp32_stock, versus_fp32 = stock, "ref"
            else:
                versus_fp32 = _spread(_paired_ratios(fp32_stock, ours, ids, args.runs))
                stock.median_ms = statistics.median(_run_times(stock, ids, 3))
            checks = [outside_ratio <= 1.0, statistics.median(latency) <= 1.0]
            if dtype != torch.float32:
                checks += [ours.delegates <= fp32_stock.delegates, ours.activation_converts == 0]
            misses += checks.count(False)
            marks = "".join("+" if ok else "x" for ok in checks)
            print(
                f"{model_name:7} {dtype_name:5} | {stock.delegates:>4} / {ours.delegates:<4} | "
                f"{stock.activation_converts:>4} / {ours.activation_converts:<5} | "
                f"{stock.constant_converts:>5} / {ours.constant_converts:<6} | "
                f"{stock_outside:>4} / {ours_outside:<4} | {outside_ratio:7.2f} | "
                f"{_spread(latency):>20} | {versus_fp32:>17} | "
                f"{stock.error:7.2g} / {ours.error:<7.2g} | {marks}",
                flush=True,
            )
    print(
        "targets: [ops outside etfold/stock <= 1][latency etfold/stock <= 1], and on bf16/fp16"
        " rows [delegates <= the fp32 program's][no activation convert outside]"
        f" (+ met, x missed); missed: {misses}"
    )


def _run_times(row: Row, ids, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        row.program.run(ids)
        times.append((time.perf_counter() - start) * 1e3)
    return times


if __name__ == "__main__":
    main()
