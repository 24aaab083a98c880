# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""DyT folds on TOSA INT: fit time, and operator counts stock vs etfold, in one process.

    .venv/bin/python bench/bench_dyt.py [--repeats N]

1. The exact integer affine fit the gamma/beta fold runs per conv: 256 TABLE codes
   x C channels, exactly affine data (every point is checked), C = 64, 1024, 4096.
   `loop` is a per-element Python fit (one dict per channel, one check per point,
   the shape of upstream ExecuTorch 1.5.1's fit); `vectorized` is
   `etfold.backends.arm._passes.tosa_integer.fit_exact_integer_affine`. Median of
   N runs; ratio = vectorized / loop. Target: C = 4096 in <= 10 ms.
2. The DyT ConvNeXt-style block of `etfold report` (random gamma/beta), quantized
   once and lowered by stock ExecuTorch and within `arm_folds_registered()`:
   TOSA operator counts, and max / mean error against fp32 eager in output LSB
   over 8 random inputs on the TOSA reference model. Ratio = etfold / stock.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time

import torch

from etfold.backends.arm import arm_folds_registered
from etfold.backends.arm._passes.tosa_integer import fit_exact_integer_affine
from etfold.decisions import collect_decisions
from etfold.demo_models.arm_dyt import MODELS
from etfold.harness.tosa_runner import lower_module_tosa, output_scales


def fit_by_loop(x: torch.Tensor, y: torch.Tensor):
    """Per-element baseline: slope from two points, then every point checked in Python."""
    xs = x.tolist()
    slopes, offsets, exact = [], [], []
    for channel in range(y.shape[1]):
        column = y[:, channel].tolist()
        mapping = dict(zip(xs, column, strict=True))
        points = sorted(mapping.items())
        if len(points) == 1:
            slope, offset = 0, points[0][1]
        else:
            (x0, y0), (x1, y1) = points[0], points[1]
            slope = (y1 - y0) // (x1 - x0)
            offset = y0 - slope * x0
        slopes.append(slope)
        offsets.append(offset)
        exact.append(all(yy == slope * xx + offset for xx, yy in points))
    return slopes, offsets, exact


def _median_ms(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench_fit(repeats: int) -> None:
    print("exact integer affine fit, 256 codes x C channels (ms, median)")
    print(f"{'C':>6} {'loop':>10} {'vectorized':>11} {'ratio':>8}")
    generator = torch.Generator().manual_seed(0)
    x = torch.arange(-128, 128)
    for channels in (64, 1024, 4096):
        slopes = torch.randint(-2, 3, (channels,), generator=generator)
        offsets = torch.randint(-300, 300, (channels,), generator=generator)
        y = x[:, None] * slopes[None, :] + offsets[None, :]
        fit = fit_exact_integer_affine(x, y)
        assert fit.all_exact and fit.slopes.tolist() == fit_by_loop(x, y)[0]
        loop = _median_ms(lambda y=y: fit_by_loop(x, y), max(1, repeats // 4))
        vectorized = _median_ms(lambda y=y: fit_exact_integer_affine(x, y), repeats)
        print(f"{channels:>6} {loop:>10.2f} {vectorized:>11.3f} {vectorized / loop:>8.4f}")


def _lsb_errors(program, module, samples):
    scale = output_scales(program)[0]
    with torch.no_grad():
        errors = torch.cat(
            [(program.run(*s).outputs[0] - module(*s)).abs().flatten() / scale for s in samples]
        )
    return float(errors.max()), float(errors.mean())


def bench_block() -> None:
    model = next(m for m in MODELS if m.name == "dyt_convnext_block")
    module, inputs = model.build()
    calibration = model.calibration()
    generator = torch.Generator().manual_seed(7)
    samples = [(torch.randn(inputs[0].shape, generator=generator),) for _ in range(8)]
    stock, _ = lower_module_tosa(copy.deepcopy(module), inputs, calibration=calibration)
    with arm_folds_registered(), collect_decisions() as decisions:
        folded, _ = lower_module_tosa(copy.deepcopy(module), inputs, calibration=calibration)
    stock_counts, folded_counts = stock.operator_counts(), folded.operator_counts()
    print(f"\n{model.name}: TOSA operators, stock vs etfold")
    print(f"{'operator':<12} {'stock':>6} {'etfold':>7} {'ratio':>7}")
    for name in sorted(set(stock_counts) | set(folded_counts)):
        if name in ("CONST", "CONST_SHAPE"):
            continue
        s, f = stock_counts[name], folded_counts[name]
        ratio = f"{f / s:.2f}" if s else "-"
        print(f"{name:<12} {s:>6} {f:>7} {ratio:>7}")
    total_s = sum(v for k, v in stock_counts.items() if not k.startswith("CONST"))
    total_f = sum(v for k, v in folded_counts.items() if not k.startswith("CONST"))
    print(f"{'total':<12} {total_s:>6} {total_f:>7} {total_f / total_s:>7.2f}")
    (stock_max, stock_mean), (folded_max, folded_mean) = (
        _lsb_errors(stock, module, samples),
        _lsb_errors(folded, module, samples),
    )
    print(
        f"{'max err LSB':<12} {stock_max:>6.2f} {folded_max:>7.2f} {folded_max / stock_max:>7.2f}"
    )
    print(
        f"{'mean err LSB':<12} {stock_mean:>6.3f} {folded_mean:>7.3f} {folded_mean / stock_mean:>7.2f}"
    )
    print("decisions:")
    for decision in decisions:
        verb = "applied" if decision.applied else "declined"
        print(f"  {decision.fold} {verb} at {decision.where}: {decision.detail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    bench_fit(args.repeats)
    bench_block()


if __name__ == "__main__":
    main()
