"""Delegated fp32 <-> fp16/bf16 converts: stock ExecuTorch vs etfold, side by side in one process.

    .venv/bin/python bench/bench_dtype_converts.py [--runs N] [--models gemma3,llama] [--fold-weights]

Tiny Gemma3 (2 layers, hidden 256, vocab 1000) and tiny Llama (2 layers, hidden
128, vocab 1000), random weights, ids (1, 32), each in fp32, bf16 and fp16.
Stock: upstream `XnnpackPartitioner(enable_bf16=True)`. etfold: etfold's
`XnnpackPartitioner(enable_bf16=True)` through `etfold.exir.to_edge_transform_and_lower`
(weight folding off unless `--fold-weights`, so the convert feature is measured alone).

Columns: delegates; float converts left outside delegates, split into converts of
activations and converts of constants (no user input reaches them: cast buffers,
masks and rotary tables computed from constants, which constant folding at export
should remove; never delegated); all ops outside (memory-planning `alloc` not
counted); median latency of interleaved runs on the XNNPACK runtime; max error
against eager in the same dtype; the latency ratio is the median of
per-pair ratios of back-to-back runs. Targets, checked per row: etfold's bf16/fp16
delegate count <= the fp32 model's, zero activation converts outside, latency <= stock.
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


def _time_paired(stock: Row, ours: Row, ids, runs: int) -> float:
    """Medians of interleaved runs, and the median of per-pair ratios (etfold / stock).

    Each pair runs both programs back to back, in alternating order, so load from
    other processes on the machine hits both sides of a ratio alike.
    """
    stock.program.run(ids)  # warm-up
    ours.program.run(ids)
    samples: dict[int, list[float]] = {id(stock): [], id(ours): []}
    ratios = []
    for i in range(runs):
        pair = (stock, ours) if i % 2 == 0 else (ours, stock)
        for row in pair:
            start = time.perf_counter()
            row.program.run(ids)
            samples[id(row)].append((time.perf_counter() - start) * 1e3)
        ratios.append(samples[id(ours)][-1] / samples[id(stock)][-1])
    stock.median_ms = statistics.median(samples[id(stock)])
    ours.median_ms = statistics.median(samples[id(ours)])
    return statistics.median(ratios)


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
    parser.add_argument("--fold-weights", action="store_true")
    args = parser.parse_args()

    ids = token_ids()
    header = (
        f"{'model':7} {'dtype':5} | {'delegates':>11} | {'act conv out':>12} | "
        f"{'const conv out':>14} | {'ops outside':>11} | {'median ms':>13} | {'ratio':>5} | "
        f"{'max err':>17} | targets | other ops outside beyond fp32 (etfold)"
    )
    print("stock / etfold in each column; ratio = median of paired etfold / stock run times")
    print(header)
    print("-" * len(header))
    misses = 0
    for model_name in args.models.split(","):
        build = MODELS[model_name]
        fp32_row = None
        for dtype_name, dtype in DTYPES.items():
            rows = {
                flavour: _lower(flavour, build(dtype), ids, args.fold_weights)
                for flavour in ("stock", "etfold")
            }
            stock, ours = rows["stock"], rows["etfold"]
            ratio = _time_paired(stock, ours, ids, args.runs)
            if dtype == torch.float32:
                fp32_row = stock
            if dtype == torch.float32:
                marks = "ref"  # the reference row: nothing for etfold to delegate
            else:
                checks = [
                    ours.delegates <= fp32_row.delegates,
                    ours.activation_converts == 0,
                    ratio <= 1.0,
                ]
                misses += checks.count(False)
                marks = "".join("+" if ok else "x" for ok in checks)
            print(
                f"{model_name:7} {dtype_name:5} | {stock.delegates:>4} / {ours.delegates:<4} | "
                f"{stock.activation_converts:>4} / {ours.activation_converts:<5} | "
                f"{stock.constant_converts:>5} / {ours.constant_converts:<6} | "
                f"{sum(stock.ops_outside.values()):>4} / {sum(ours.ops_outside.values()):<4} | "
                f"{stock.median_ms:5.2f} / {ours.median_ms:5.2f} | {ratio:5.2f} | "
                f"{stock.error:7.2g} / {ours.error:<7.2g} | {marks:>7} | {_extra_ops(ours, fp32_row)}",
                flush=True,
            )
    print(
        "targets (bf16/fp16 rows): [delegates <= fp32 model's][no activation convert outside]"
        f"[latency <= stock] (+ met, x missed); missed: {misses}"
    )


if __name__ == "__main__":
    main()
