# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Arm folds on the NPU: Vela's cycle estimate, stock vs etfold vs unfolded, per target.

    .venv/bin/python bench/bench_arm_npu.py [--models NAME ...] [--targets T ...]
                                            [--quantizer ethos-u|tosa]
                                            [--calibration-samples N] [--held-out N]
                                            [--rollout-steps N] [--skip-rollout]

1. Every Arm report model in `etfold.demo_models.arm_npu_blocks` (plus the DyT
   ConvNeXt block), quantized for each Ethos-U target and lowered through
   ExecuTorch's EthosUPartitioner three ways: unfolded (neither upstream's fold
   nor etfold's), stock ExecuTorch, and etfold (`arm_folds_registered()`).
   Printed per model and target: Vela's total cycles, NPU cycles, the TOSA MUL
   and total operator counts Vela was handed, and the ratios etfold/stock and
   etfold/unfolded. Vela's estimate is deterministic: no repeats, no spread.
   The models: the report models, `conv_scale_net` as its issue gave it and with
   three seeds of random per-channel scales, and ExecuTorch's own MLPerf Tiny
   models, summed into one TinyML row per target. Then, per model and target,
   Vela's per-layer cycles stock vs etfold where they differ (layers matched in
   schedule order by operator), so a regression names its layer.
   `--no-precision` skips the precision half (Vela cycles only); `--no-unfolded`
   lowers stock and etfold only.
   `--quantizer tosa` quantizes with TOSAQuantizer (a TOSA spec: the NPU is not
   named until lowering) instead of EthosUQuantizer; folds made before
   calibration then cannot ask which NPU the program is for.
   Then the precision of the same three quantized programs: each is also lowered
   to TOSA INT with the target's fold decisions and run on the TOSA reference
   model; max and mean |output - fp32 eager| in output LSB over held-out inputs.
   A `!` marks etfold worse than unfolded by more than 0.5 LSB max or 0.05 mean.
   Every lowering here calibrates on the example inputs and 16 fresh samples
   of their distribution (`--calibration-samples`): with the catalogue's 4, held-out inputs leave calibrated
   ranges and the max error measures where a tensor clips (bn_free_conv_net:
   9.6 LSB unfolded, 3.8 with 16), not how a fold rounds.
2. Carried state: the GRU-like cell rolled for N steps (default 1,000) on the
   TOSA reference model, carrying its hidden state, lowered unfolded (what the
   carried-state guard keeps), folded (stock's unguarded fold) and with etfold;
   the drift in output LSB against fp32 eager rolled the same way, as the mean
   error over the first and last tenth of the rollout and the least-squares
   slope in LSB per step, beside each lowering's Vela cycles.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import logging
import math
import warnings

import torch

from etfold.backends.arm import arm_folds_registered
from etfold.backends.arm._passes.lowering_target import lowering_for
from etfold.backends.arm.registration import upstream_folds_retired
from etfold.decisions import collect_decisions
from etfold.demo_models import all_models
from etfold.harness.tosa_runner import (
    INT,
    lower_module_tosa,
    lower_tosa,
    output_scales,
    quantize_for_tosa,
    run_carried,
)
from etfold.harness.vela import (
    TARGETS,
    VelaLayer,
    ethos_u_compile_spec,
    lower_ethos_u,
    quantize_for_ethos_u,
)

FLAVOURS = {
    "unfolded": upstream_folds_retired,
    "stock": contextlib.nullcontext,
    "etfold": arm_folds_registered,
}
DEFAULT_MODELS = (
    "convnext_layerscale_block",
    "vit_dyt_layerscale_block",
    "dyt_convnext_block",
    "bn_free_conv_net",
    "scaled_conv_forms",
    "convnext_atto_layerscale",
    "gru_conv_cell",
    "conv_scale_net",
    "conv_scale_net_scales_seed1",
    "conv_scale_net_scales_seed2",
    "conv_scale_net_scales_seed3",
)
TINYML_MODELS = (
    "mlperf_tiny_ds_cnn",
    "mlperf_tiny_mobilenet_v1_025",
    "mlperf_tiny_resnet8",
    "mlperf_tiny_deep_autoencoder",
)
QUANTIZERS = {
    "ethos-u": lambda module, inputs, target, calibration: quantize_for_ethos_u(
        module, inputs, target, calibration=calibration
    ),
    "tosa": lambda module, inputs, target, calibration: quantize_for_tosa(
        module, inputs, calibration=calibration
    ),
}
settings = {
    "quantizer": "ethos-u",
    "calibration": 16,
    "held_out": 4,
    "precision": True,
    "unfolded": True,
}
# etfold may be no less precise than the unfolded lowering, within these (LSB)
MAX_ERROR_SLACK, MEAN_ERROR_SLACK = 0.5, 0.05


def _ops(counts) -> int:
    return sum(v for k, v in counts.items() if not k.startswith("CONST"))


_measured: dict[tuple[str, str], dict[str, tuple]] = {}


def measure(model, target: str) -> dict[str, tuple]:
    """Vela's estimate, TOSA operator counts and decisions per lowering (computed once)."""
    if (model.name, target) not in _measured:
        _measured[model.name, target] = _measure(model, target)
    return _measured[model.name, target]


def _measure(model, target: str) -> dict[str, tuple]:
    module, inputs = model.build()
    calibration = _samples_like(inputs, settings["calibration"], seed=2)
    held_out = _samples_like(inputs, settings["held_out"], seed=7)
    quantize = QUANTIZERS[settings["quantizer"]]
    results = {}
    for flavour, context in _flavours().items():
        with context(), collect_decisions() as decisions:
            quantized = quantize(copy.deepcopy(module), inputs, target, calibration)
            program = lower_ethos_u(quantized, target)
            if settings["precision"]:
                with lowering_for(ethos_u_compile_spec(target)):
                    reference = lower_tosa(copy.deepcopy(quantized), INT)
        errors = (
            _errors_against_eager(reference, module, held_out)
            if settings["precision"]
            else (math.nan, math.nan)
        )
        unique = list(dict.fromkeys(decisions))
        results[flavour] = (program.estimate, program.operator_counts(), unique, errors)
    return results


def _flavours() -> dict:
    return {f: c for f, c in FLAVOURS.items() if settings["unfolded"] or f != "unfolded"}


def _cycles_cell(estimate) -> str:
    return f"{estimate.total_cycles:>9}" if estimate is not None else f"{'-':>9}"


def _ratio_cell(numerator, denominator) -> str:
    if denominator is None:
        return f"{'-':>7}"
    return f"{numerator / denominator:>7.3f}"


def _samples_like(inputs: tuple, count: int, seed: int) -> list[tuple]:
    """`count` samples shaped like `inputs`, each tensor drawn with its mean and spread."""
    generator = torch.Generator().manual_seed(seed)
    return [
        tuple(
            i.mean() + i.std() * torch.randn(i.shape, generator=generator, dtype=i.dtype)
            for i in inputs
        )
        for _ in range(count)
    ]


def _errors_against_eager(program, module, held_out) -> tuple[float, float]:
    """(max, mean) |program - fp32 eager| in output LSB; each call from the module's state."""
    lsb = output_scales(program)[0]
    largest, total = 0.0, 0.0
    with torch.no_grad():
        for sample in held_out:
            error = (program.run(*sample).outputs[0] - copy.deepcopy(module)(*sample)).abs() / lsb
            largest = max(largest, float(error.max()))
            total += float(error.mean())
    return largest, total / len(held_out)


def print_row(name: str, target: str, results: dict[str, tuple]) -> None:
    stock, etfold = results["stock"][0], results["etfold"][0]
    unfolded = results["unfolded"][0] if "unfolded" in results else None
    counts = {f: results[f][1] for f in results}
    print(
        f"{name:<27} {target:<14} "
        f"{_cycles_cell(unfolded)} {stock.total_cycles:>9} {etfold.total_cycles:>9} "
        f"{etfold.total_cycles / stock.total_cycles:>7.3f} "
        f"{_ratio_cell(etfold.total_cycles, unfolded and unfolded.total_cycles)} "
        f"{etfold.npu_cycles / stock.npu_cycles:>7.3f} "
        f"{counts['stock']['MUL']:>3}/{counts['etfold']['MUL']:<3} "
        f"{_ops(counts['stock']):>4}/{_ops(counts['etfold']):<4}"
    )


def print_error_row(name: str, target: str, results: dict[str, tuple]) -> None:
    errors = {f: results[f][3] for f in FLAVOURS}
    worse = (
        errors["etfold"][0] > errors["unfolded"][0] + MAX_ERROR_SLACK
        or errors["etfold"][1] > errors["unfolded"][1] + MEAN_ERROR_SLACK
    )
    cells = "".join(f" {errors[f][0]:>7.2f}/{errors[f][1]:<7.3f}" for f in FLAVOURS)
    print(f"{name:<27} {target:<14}{cells} {'!' if worse else ''}")


def layer_diff(stock: tuple[VelaLayer, ...], etfold: tuple[VelaLayer, ...]) -> list[str]:
    """Vela's per-layer cycles where stock and etfold differ: layers matched in schedule
    order by operator (Vela's names differ between lowerings), unmatched ones listed alone."""
    matcher = difflib.SequenceMatcher(None, _kinds(stock), _kinds(etfold), autojunk=False)
    lines = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        pairs = zip(stock[i1:i2], etfold[j1:j2], strict=True) if tag == "equal" else ()
        for index, (a, b) in enumerate(pairs, start=i1):
            if a.cycles != b.cycles:
                lines.append(_layer_line(index, a, a.cycles, b.cycles, f"{a.name} / {b.name}"))
        if tag != "equal":
            lines += [
                _layer_line(i, a, a.cycles, 0, a.name) for i, a in enumerate(stock[i1:i2], i1)
            ]
            lines += [
                _layer_line(j, b, 0, b.cycles, b.name) for j, b in enumerate(etfold[j1:j2], j1)
            ]
    return lines


def _kinds(layers: tuple[VelaLayer, ...]) -> list[tuple[str, str]]:
    return [(layer.operator, layer.npu_operator) for layer in layers]


def _layer_line(index: int, layer: VelaLayer, stock: int, etfold: int, names: str) -> str:
    operator = f"{layer.operator}->{layer.npu_operator}"
    return f"    #{index:<3} {operator:<26} {stock:>9} {etfold:>9} {etfold - stock:>+9}  {names}"


def print_layer_diffs(names, targets) -> None:
    print("\nVela per-layer cycles where stock and etfold differ (#: schedule position)")
    print(f"    {'#':<4} {'TOSA->Vela op':<26} {'stock':>9} {'etfold':>9} {'diff':>9}  names")
    for name in names:
        for target in targets:
            results = _measured[name, target]
            lines = layer_diff(results["stock"][0].layers, results["etfold"][0].layers)
            print(f"  {name} {target}: {'' if lines else 'same cycles in every layer'}")
            for line in lines:
                print(line)


def print_tinyml_row(targets) -> None:
    for target in targets:
        totals = {
            f: sum(_measured[n, target][f][0].total_cycles for n in TINYML_MODELS)
            for f in _flavours()
        }
        unfolded = totals.get("unfolded")
        print(
            f"{'TinyML (MLPerf Tiny, sum)':<27} {target:<14} "
            f"{unfolded if unfolded is not None else '-':>9} {totals['stock']:>9} "
            f"{totals['etfold']:>9} {totals['etfold'] / totals['stock']:>7.3f} "
            f"{_ratio_cell(totals['etfold'], unfolded)}"
        )


def bench_models(names, targets) -> None:
    models = {m.name: m for m in all_models() if m.backend == "arm"}
    print(
        f"quantizer: {settings['quantizer']}; calibration: the example inputs and "
        f"{settings['calibration']} samples; {settings['held_out']} held-out inputs"
    )
    print("Vela total cycles (unfolded, stock, etfold); ratios etfold/stock, etfold/unfolded;")
    print("NPU-cycle ratio etfold/stock; TOSA MULs and operators stock/etfold")
    print(
        f"{'model':<27} {'target':<14} {'unfolded':>9} {'stock':>9} {'etfold':>9} "
        f"{'e/s':>7} {'e/u':>7} {'npu e/s':>7} {'MUL s/e':>7} {'ops s/e':>9}"
    )
    notes = []
    for name in names:
        for target in targets:
            results = measure(models[name], target)
            print_row(name, target, results)
            for decision in results["etfold"][2]:
                verb = "applied" if decision.applied else "declined"
                notes.append(
                    f"  {name} {target}: {decision.fold} {verb} at {decision.where}: {decision.detail}"
                )
    if set(TINYML_MODELS) <= set(names):
        print_tinyml_row(targets)
    print_layer_diffs(names, targets)
    if settings["precision"] and settings["unfolded"]:
        print(
            "\nerror vs fp32 eager on the TOSA reference model, max/mean LSB"
            " (same quantized programs)"
        )
        print(f"{'model':<27} {'target':<14}" + "".join(f" {f:>15}" for f in FLAVOURS))
        for name in names:
            for target in targets:
                print_error_row(name, target, measure(models[name], target))
    print("etfold decisions:")
    print("\n".join(dict.fromkeys(notes)))


ROLLOUT_MODELS = ("gru_conv_cell", "recurrent_conv_cell_int8")


def _rollout_errors(program, module, steps) -> tuple[list[float], list[torch.Tensor]]:
    """Per step: mean |lowered - fp32 eager| in output LSB, both rolled from a zero state."""
    eager = copy.deepcopy(module)
    lowered = program.exported_program.module(check_guards=False)
    carried = {name for name, _ in lowered.named_buffers()}
    zero = {n: torch.zeros_like(b) for n, b in eager.named_buffers() if n in carried}
    for name, buffer in eager.named_buffers():
        if name in zero:
            buffer.zero_()
    lsb = output_scales(program)[0]
    outputs = [r.outputs[0] for r in run_carried(program, steps, buffers=zero)]
    errors = []
    with torch.no_grad():
        for out, inputs in zip(outputs, steps, strict=True):
            errors.append(float((out - eager(*inputs)).abs().mean()) / lsb)
    return errors, [torch.round(o / lsb) for o in outputs]


def _slope(values: list[float]) -> float:
    t = torch.arange(len(values), dtype=torch.float64)
    v = torch.tensor(values, dtype=torch.float64)
    t = t - t.mean()
    return float((t * (v - v.mean())).sum() / (t * t).sum())


def bench_rollout(step_count: int, targets) -> None:
    models = {m.name: m for m in all_models() if m.backend == "arm"}
    print(f"\ncarried state: {step_count}-step rollout on the TOSA reference model (INT)")
    print("error = mean |lowered - fp32 eager| per step, in output LSB; slope in LSB/step;")
    print("codes = steps whose output codes equal the unfolded lowering's; cycles from Vela")
    header = (
        f"{'model':<26} {'lowering':<9} {'first10%':>8} {'last10%':>8} {'slope':>10} {'codes':>6}"
    )
    print(header + "".join(f" {t:>14}" for t in targets))
    for name in ROLLOUT_MODELS:
        model = models[name]
        module, inputs = model.build()
        generator = torch.Generator().manual_seed(11)
        steps = [(torch.randn(inputs[0].shape, generator=generator),) for _ in range(step_count)]
        cycles = {t: measure(model, t) for t in targets}
        unfolded_codes = None
        for flavour, context in FLAVOURS.items():
            with context(), collect_decisions() as decisions:
                program, _ = lower_module_tosa(
                    copy.deepcopy(module), inputs, calibration=model.calibration()
                )
            errors, codes = _rollout_errors(program, module, steps)
            if unfolded_codes is None:
                unfolded_codes = codes
            same = sum(torch.equal(a, b) for a, b in zip(codes, unfolded_codes, strict=True))
            tenth = max(1, step_count // 10)
            row = (
                f"{name:<26} {flavour:<9} {sum(errors[:tenth]) / tenth:>8.3f} "
                f"{sum(errors[-tenth:]) / tenth:>8.3f} {_slope(errors):>10.2e} {same:>6}"
            )
            print(row + "".join(f" {cycles[t][flavour][0].total_cycles:>14}" for t in targets))
            if flavour == "etfold":
                for decision in decisions:
                    verb = "applied" if decision.applied else "declined"
                    print(f"    {decision.fold} {verb} at {decision.where}: {decision.detail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=[*DEFAULT_MODELS, *TINYML_MODELS])
    parser.add_argument("--targets", nargs="*", default=list(TARGETS))
    parser.add_argument("--quantizer", choices=sorted(QUANTIZERS), default="ethos-u")
    parser.add_argument("--calibration-samples", type=int, default=16)
    parser.add_argument("--held-out", type=int, default=4)
    parser.add_argument(
        "--no-precision", action="store_true", help="Vela cycles only: no TOSA reference runs"
    )
    parser.add_argument(
        "--no-unfolded", action="store_true", help="lower stock and etfold only (no precision)"
    )
    parser.add_argument("--rollout-steps", type=int, default=1000)
    parser.add_argument("--skip-rollout", action="store_true")
    args = parser.parse_args()
    settings.update(
        quantizer=args.quantizer,
        calibration=args.calibration_samples,
        held_out=args.held_out,
        precision=not args.no_precision,
        unfolded=not args.no_unfolded,
    )
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    if args.models:
        bench_models(args.models, args.targets)
    if not args.skip_rollout:
        bench_rollout(args.rollout_steps, args.targets)


if __name__ == "__main__":
    main()
