# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Audio encoders declared in samples: the dynamic program against its static twin.

    .venv/bin/python bench/bench_dynamic_audio.py [--budget 30] [--runs 20]
                                                  [--held-out] [--no-timing]
                                                  [--only-held-out HubertModel,...]

The model: transformers' Wav2Vec2Model, random weights (hidden 128, 2 layers, 4 heads,
conv_dim (64, 64, 64), kernels (10, 3, 3), strides (5, 2, 2): a frame per 20 samples),
input (1, 16000), exported static and with
`dynamic_shapes=({1: Dim.DYNAMIC(min=4000, max=32000)},)`, lowered with etfold's
XnnpackPartitioner through `etfold.exir.to_edge_transform_and_lower`, lowering and
`to_executorch` inside `etfold.exir.declared_bounds_kept()`; stock's static and dynamic
programs beside them (stock's dynamic one is planned for 20,480 samples).

Printed:
  delegates / kernel calls outside them (in the .pte; views, symbolic sizes and scalar
  arithmetic not counted), and the max error against eager at 4,000, 18,001 and
  32,000 samples (or why the runtime refused the length);
  ms per call at 16,000 samples, one thread, interleaved (etfold.harness.timing), and
  the per-round ratio dynamic/static (median, p10-p90);
  ETDump of `--runs` calls of each etfold program: ms per call by XNNPACK operator
  kind (median over the calls), and the delegate calls' time no operator accounts for
  (XNNPACK's reshape and setup, argument copies).
`--held-out`: transformers' other encoders of this kind, tiny configs of the same
shape, static and dynamic: delegates / ops outside, and the dynamic program's errors
(`--only-held-out`: those named, and nothing else).
The programs are the registry's (`etfold.harness.bench_models`): `wav2vec2_short_convs_*`
and `held_out_<model class>_*`, each `_static` and `_dynamic`.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as StockPartitioner,
)

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.bench_models import AUDIO_SAMPLES as TRACED
from etfold.harness.bench_models import HELD_OUT_AUDIO as HELD_OUT
from etfold.harness.bench_models import BenchModel, audio, bench_model, shaped
from etfold.harness.llama_export import ops_outside, pte_contents
from etfold.harness.timing import time_interleaved
from etfold.harness.xnnpack_runner import eager_outputs, lower_xnnpack, max_abs_error

LENGTHS = (4000, 18001, 32000)
SHAPES = ("static", "dynamic")


def registered(name: str) -> dict[str, BenchModel]:
    """shapes -> the registry's program `name` exported with them."""
    return {shapes: bench_model(shaped(name, shapes == "dynamic")) for shapes in SHAPES}


def lowered(module, model: BenchModel, partitioner: str):
    dynamic = model.dynamic_shapes() if model.dynamic_shapes else None
    program = torch.export.export(module, audio(TRACED), dynamic_shapes=dynamic)
    kept = partitioner in model.bounds_kept
    if partitioner == "stock":
        return lower_xnnpack(program, [StockPartitioner()], keep_declared_bounds=kept)
    return lower_xnnpack(
        program,
        [XnnpackPartitioner()],
        lower=to_edge_transform_and_lower,
        keep_declared_bounds=kept,
    )


def _errors(module, program, lengths) -> str:
    said = []
    for length in lengths:
        inputs = audio(length)
        try:
            error = max_abs_error(program.run(*inputs), eager_outputs(module, inputs))
            said.append(f"{length}: {error:.1e}")
        except RuntimeError as refused:
            said.append(f"{length}: refused ({str(refused).splitlines()[0][:60]})")
    return ", ".join(said)


def _outside(program) -> tuple[int, Counter]:
    counted = ops_outside(pte_contents(program.executorch.buffer))
    return sum(counted.values()), counted


def etdump_by_kind(buffer: bytes, runs: int, workdir: Path) -> tuple[dict[str, float], float]:
    """ms per call by XNNPACK operator kind (numbers dropped), and the delegate calls' ms
    no operator accounts for; medians over `runs` calls after two warm-up calls."""
    from executorch.devtools import Inspector
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(buffer, enable_etdump=True)
    method = program.load_method("forward")
    inputs = audio(TRACED)
    for _ in range(runs + 2):
        method.execute(inputs)
    etdump, debug = workdir / "run.etdp", workdir / "run.bin"
    program.write_etdump_result_to_file(str(etdump), str(debug))
    per_call: dict[str, list[float]] = defaultdict(lambda: [0.0] * (runs + 2))
    for block in Inspector(etdump_path=str(etdump)).event_blocks:
        for event in block.events:
            if event.perf_data is None:
                continue
            kind = re.sub(r" #\d+$", "", event.name)
            for call, ms in enumerate(event.perf_data.raw[: runs + 2]):
                per_call[kind][call] += ms
    framework = {"Method::execute", "DELEGATE_CALL", "OPERATOR_CALL"}
    framework |= {k for k in per_call if k.startswith(("Method::", "Program::"))}
    in_delegates = [
        per_call["DELEGATE_CALL"][c]
        - sum(v[c] for k, v in per_call.items() if k not in framework and "native_call" not in k)
        for c in range(2, runs + 2)
    ]
    medians = {k: statistics.median(v[2:]) for k, v in per_call.items()}
    return medians, statistics.median(in_delegates)


def wav2vec2_rows(args) -> None:
    models = registered("wav2vec2_short_convs")
    module, _ = models["static"].build()
    programs = {}
    for partitioner in ("stock", "etfold"):
        for shapes in SHAPES:
            started = time.perf_counter()
            program = lowered(module, models[shapes], partitioner)
            seconds = time.perf_counter() - started
            outside, counted = _outside(program)
            lengths = (TRACED,) if shapes == "static" else LENGTHS
            print(
                f"{partitioner:6} {shapes:7} {program.delegates()} delegates, {outside} outside "
                f"({', '.join(f'{op} x{n}' for op, n in counted.items()) or '-'}); "
                f"lowered in {seconds:.0f} s; errors {_errors(module, program, lengths)}",
                flush=True,
            )
            programs[f"{partitioner} {shapes}"] = program
    if args.no_timing:
        return
    inputs = audio(TRACED)
    timing = time_interleaved(
        {name: (lambda p=p: p.run(*inputs)) for name, p in programs.items()},
        budget_s=args.budget,
        min_rounds=args.runs,
    )
    for name, spread in timing.milliseconds.items():
        print(f"{name:15} {spread.median:.2f} ms ({spread.p10:.2f}-{spread.p90:.2f})")
    for shapes in ("stock", "etfold"):
        ratio = timing.ratios[(f"{shapes} static", f"{shapes} dynamic")]
        print(f"{shapes} dynamic/static {ratio.median:.3f} ({ratio.p10:.3f}-{ratio.p90:.3f})")
    print(f"({timing.rounds} rounds x {timing.inner})")
    with tempfile.TemporaryDirectory() as workdir:
        for shapes in ("static", "dynamic"):
            buffer = programs[f"etfold {shapes}"].executorch.buffer
            kinds, unaccounted = etdump_by_kind(buffer, args.runs, Path(workdir))
            ranked = sorted(kinds.items(), key=lambda kv: -kv[1])
            print(f"ETDump etfold {shapes}: " + "; ".join(f"{k} {ms:.3f}" for k, ms in ranked))
            print(f"  delegate time no operator accounts for: {unaccounted:.3f} ms")


def held_out_rows(names) -> None:
    print("\n== held out: delegates / ops outside (kernels in the .pte), static -> dynamic")
    for name in names:
        models = registered(f"held_out_{name}")
        module, _ = models["static"].build()
        said = []
        for shapes in SHAPES:
            try:
                program = lowered(module, models[shapes], "etfold")
            except Exception as error:  # a failure is a row of the table
                said.append(f"{shapes} fails: {type(error).__name__}: {str(error)[:100]}")
                continue
            outside, counted = _outside(program)
            row = f"{shapes} {program.delegates()}/{outside}"
            if shapes == "dynamic":
                row += f" ({dict(counted)}; errors {_errors(module, program, LENGTHS)})"
            said.append(row)
        print(f"{name:24} " + "; ".join(said), flush=True)


def main() -> None:
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=30.0, help="timing seconds")
    parser.add_argument("--runs", type=int, default=20, help="rounds at least; ETDump calls")
    parser.add_argument("--held-out", action="store_true", help="the held-out encoders too")
    parser.add_argument("--only-held-out", default="", help="these held-out encoders alone")
    parser.add_argument("--no-timing", action="store_true", help="lowerings and errors only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _unsafe_reset_threadpool(1)
    if args.only_held_out:
        held_out_rows(args.only_held_out.split(","))
        return
    wav2vec2_rows(args)
    if args.held_out:
        held_out_rows(list(HELD_OUT))


if __name__ == "__main__":
    main()
