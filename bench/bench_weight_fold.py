# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Parameter-only GEMM weights on XNNPACK: stock vs etfold vs hand-folded, side by side in one process.

    .venv/bin/python bench/bench_weight_fold.py [--runs N] [--models pos_conv,spectral,conv2d,hifigan]
                                               [--frames 499] [--export-repeats N]

Models (random weights, seeded):
  pos_conv  wav2vec2-large positional conv, weight_norm(Conv1d(1024,1024,128,padding=64,groups=16),dim=2)
            + same-pad trim + GELU, on (1,1024,T), T=--frames (499)
  spectral  spectral_norm(Linear(1024,1024)) on (1,128,1024)
  conv2d    weight_norm(Conv2d(64,128,3)) on (1,64,56,56)
  hifigan   transformers SpeechT5HifiGan, small random config (80 mels, 128 channels, 2 upsamples),
            apply_weight_norm(), 64 frames

Lowerings: stock = upstream XnnpackPartitioner through upstream to_edge_transform_and_lower;
etfold = etfold's XnnpackPartitioner through etfold.exir.to_edge_transform_and_lower;
hand = the same model built again from the same seed with every parametrization removed
before export (a deepcopy would share the parametrized class), lowered the stock way.

Columns: delegates and ops outside delegates (memory-planning `alloc` not counted), median
latency of interleaved runs on the XNNPACK runtime (--runs per lowering; one slower than 1 s
per call gets at most 3, one faster than 0.1 s gets 10x --runs), max error against eager
of the parametrized model. Ratios: stock/etfold speedup and etfold/hand latency.
`e == h`: etfold's delegate payloads and .pte size equal the hand-folded lowering's
(then any latency difference between the two is measurement noise).
Targets: >= 300x on pos_conv, etfold/hand <= 1.05 on every model.

Export time: `to_edge_transform_and_lower` with the hook (fold_weights=True) vs without
(fold_weights=False), both through etfold's entry point, median of --export-repeats, on a model
with nothing to fold (hand-folded HiFi-GAN) and on one that folds (weight_norm HiFi-GAN).
Target: <= 1.05x when nothing folds.
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
from executorch.exir import to_edge_transform_and_lower as upstream_lower

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.demo_models.xnnpack_weight_norm import remove_parametrizations
from etfold.exir import to_edge_transform_and_lower as etfold_lower
from etfold.harness.bench_models import weight_fold_models as models
from etfold.harness.inspection import lowered_modules
from etfold.harness.xnnpack_runner import (
    XnnpackProgram,
    eager_outputs,
    lower_xnnpack,
    max_abs_error,
)


@dataclass
class Row:
    program: XnnpackProgram
    delegates: int
    outside: int
    error: float
    median_ms: float = float("nan")


def _lower(flavour: str, build) -> Row:
    module, inputs = build()
    reference = eager_outputs(module, inputs)
    if flavour == "hand":
        module = remove_parametrizations(module)
    program = torch.export.export(module, inputs)
    if flavour == "etfold":
        lowered = lower_xnnpack(program, [XnnpackPartitioner()], lower=etfold_lower)
    else:
        lowered = lower_xnnpack(program, [UpstreamXnnpackPartitioner()], lower=upstream_lower)
    outside = sum(n for op, n in lowered.ops_outside().items() if op != "alloc")
    return Row(
        lowered, lowered.delegates(), outside, max_abs_error(lowered.run(*inputs), reference)
    )


def _delegate_payloads(row: Row) -> list[bytes]:
    return [m.processed_bytes for m in lowered_modules(row.program.edge.exported_program())]


def _time(rows: dict[str, Row], inputs, runs: int) -> None:
    budget = {}
    for name, row in rows.items():
        start = time.perf_counter()
        row.program.run(*inputs)  # warm-up
        elapsed = time.perf_counter() - start
        # slow stock lowerings get a few runs; millisecond ones many, so the median settles
        budget[name] = min(runs, 3) if elapsed > 1.0 else runs * (10 if elapsed < 0.1 else 1)
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for i in range(max(budget.values())):
        for name, row in rows.items():
            if i < budget[name]:
                start = time.perf_counter()
                row.program.run(*inputs)
                samples[name].append((time.perf_counter() - start) * 1e3)
    for name, row in rows.items():
        row.median_ms = statistics.median(samples[name])


def _exported(build, hand: bool):
    module, inputs = build()
    if hand:
        module = remove_parametrizations(module)
    return torch.export.export(module, inputs)


def _export_seconds(build, fold_weights: bool, hand: bool) -> float:
    program = _exported(build, hand)
    start = time.perf_counter()
    etfold_lower(program, partitioner=[XnnpackPartitioner(fold_weights=fold_weights)])
    return time.perf_counter() - start


def _hook_seconds(build, hand: bool, repeats: int = 5) -> float:
    """The hook alone (`transform_for_pre_decomposition`), on a fresh export each time."""
    samples = []
    for _ in range(repeats):
        program = _exported(build, hand)
        partitioner = XnnpackPartitioner()
        start = time.perf_counter()
        partitioner.transform_for_pre_decomposition(program)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def export_times(build, repeats: int) -> list[tuple[str, float, float, float]]:
    results = []
    cases = (
        ("nothing to fold (hand-folded hifigan)", True),
        ("folds (weight_norm hifigan)", False),
    )
    for label, hand in cases:
        with_hook, without = [], []
        for i in range(repeats):  # interleaved, alternating order, so load hits both alike
            for fold_weights in (True, False) if i % 2 else (False, True):
                seconds = _export_seconds(build, fold_weights, hand)
                (with_hook if fold_weights else without).append(seconds)
        median_with, median_without = statistics.median(with_hook), statistics.median(without)
        results.append((label, median_without, median_with, _hook_seconds(build, hand)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--frames", type=int, default=499)
    parser.add_argument("--models", default="pos_conv,spectral,conv2d,hifigan")
    parser.add_argument("--export-repeats", type=int, default=5)
    args = parser.parse_args()

    builders = models(args.frames)
    header = (
        f"{'model':9} | {'delegates s/e/h':>15} | {'outside s/e/h':>15} | "
        f"{'median ms stock / etfold / hand':>33} | {'stock/etfold':>12} | {'etfold/hand':>11} | "
        f"{'max err s / e / h':>26} | e == h"
    )
    print(header)
    print("-" * len(header))
    notes = Counter()
    for name in args.models.split(","):
        build = builders[name]
        rows = {flavour: _lower(flavour, build) for flavour in ("stock", "etfold", "hand")}
        _, inputs = build()
        _time(rows, inputs, args.runs)
        s, e, h = rows["stock"], rows["etfold"], rows["hand"]
        speedup, vs_hand = s.median_ms / e.median_ms, e.median_ms / h.median_ms
        same = (
            _delegate_payloads(e) == _delegate_payloads(h)
            and e.program.pte_bytes == h.program.pte_bytes
        )
        notes["vs_hand_miss"] += vs_hand > 1.05
        if name == "pos_conv":
            notes["pos_conv_speedup"] = speedup
        print(
            f"{name:9} | {s.delegates:>4}/{e.delegates}/{h.delegates:<7} | {s.outside:>4}/{e.outside}/{h.outside:<7} | "
            f"{s.median_ms:>11.3f} / {e.median_ms:>8.3f} / {h.median_ms:>8.3f} | {speedup:>11.1f}x | "
            f"{vs_hand:>10.3f}x | {s.error:8.2g} / {e.error:8.2g} / {h.error:8.2g} | "
            f"{'yes' if same else 'no'}",
            flush=True,
        )

    print()
    print("export time, etfold.exir.to_edge_transform_and_lower, median seconds")
    ratios, hook_shares = [], []
    for label, without, with_hook, hook in export_times(builders["hifigan"], args.export_repeats):
        ratios.append(with_hook / without)
        hook_shares.append(hook / without)
        print(
            f"  {label:40} without hook {without:7.3f}  with hook {with_hook:7.3f}  "
            f"ratio {with_hook / without:5.3f}x  (hook alone {hook * 1e3:8.2f} ms)"
        )
    print()
    closing = [
        f"etfold/hand latency within 1.05x on {'every model' if not notes['vs_hand_miss'] else 'all but ' + str(notes['vs_hand_miss'])}",
        f"export with hook / without, nothing to fold: {ratios[0]:.3f}x (target <= 1.05x; "
        f"the hook alone is {1 + hook_shares[0]:.4f}x of the unhooked lowering)",
        f"export with hook / without, folding: {ratios[1]:.3f}x",
    ]
    if "pos_conv_speedup" in notes:
        closing.insert(
            0, f"pos_conv stock/etfold: {notes['pos_conv_speedup']:.0f}x (target >= 300x)"
        )
    print("closing note: " + "; ".join(closing))


if __name__ == "__main__":
    main()
