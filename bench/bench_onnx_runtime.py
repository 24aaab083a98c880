# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""ONNX Runtime as a peer column: stock ExecuTorch, etfold and ORT on the same exported programs.

    .venv/bin/python bench/bench_onnx_runtime.py [--rows bert,wav2vec2,...] [--budget S]
        [--runs N] [--no-profile] [--markdown]

Needs `pip install 'etfold[peers]'` (onnxruntime, onnx, onnxscript).

Rows, each static and with a dynamic length (`torch.export.Dim` bounds), random
weights from configs in code (each row names its program in `etfold.harness.bench_models`):
  bert         HF BertModel, hidden 128, 2 layers, 4 heads (bench_llm_export's);
               64 tokens, dynamic 8..128
  wav2vec2     HF Wav2Vec2Model, hidden 128, 2 layers (bench_llm_export's); 16,000 samples;
               dynamic declared in frames (320 * Dim(13..100), as bench_llm_export declares
               it) and in samples (Dim.DYNAMIC(min=4000, max=32000), as users declare it)
  llama        HF LlamaForCausalLM, hidden 128, 2 layers, 4 / 2 KV heads; 32 tokens,
               dynamic 4..64
  bert_base    HF BertModel at BERT-base width: hidden 768, 12 heads, intermediate 3072,
               vocab 30522, 4 layers; 128 tokens, dynamic 8..256
  hifigan      transformers SpeechT5HifiGan with weight_norm (bench_weight_fold's config);
               64 frames, dynamic 16..128
  mobilenet    ExecuTorch's MLPerf Tiny MobileNetV1-0.25 on 96x96; dynamic 64..128 square
  lstm         bench_recurrent's LSTM(32, 32) + two linears + log_softmax on 32 steps;
               dynamic 8..64 steps

Each row exports the module once per runtime with the same call
(`torch.export.export(module, inputs, dynamic_shapes=...)`): stock lowers it with
upstream's entry point and partitioner, etfold with its own, and ORT gets
`torch.onnx.export(program, dynamo=True, optimize=True)` of its ExportedProgram, in a
session with one intra-op and one inter-op thread and `ORT_ENABLE_ALL`; the
ExecuTorch threadpool is reset to one thread. A failure is named by whose it is
(torch.export, stock, etfold, ORT export, ORT run) and the row goes on without it.
Outputs are checked against eager (max abs error) at the static length.

Timing: the three, two loads each, interleaved through `etfold.harness.timing`
(rotating call order) at the static length; median ms per call, and per-round
ratios ORT/etfold and ORT/stock with their p10-p90 (below 1: ORT faster).

Where etfold is behind ORT (ORT/etfold below 0.97), and on the wav2vec2 row declared
in samples, the row is profiled: an ETDump
of etfold's program (XNNPACK's per-operator events inside delegates, kernels
outside them) beside ORT's own profiler, compared by kind of work
(`etfold.harness.op_profiles`); the time outside kernels on each side is the
timed p10 minus the profiled kernels.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from etfold.harness import bench_models, onnx_peer, op_profiles
from etfold.harness.timing import Spread, time_interleaved

BEHIND = 0.97  # ORT/etfold below this: profile where etfold's time goes


@dataclass(frozen=True)
class Row:
    name: str
    shapes: str  # static, dynamic, dynamic (samples), ...
    model: str  # the registry's program (`etfold.harness.bench_models`)
    declared: str = ""  # the bounds, as the table shows them
    profile: bool = False  # profile even when etfold is not behind ORT

    def build(self) -> tuple[torch.nn.Module, tuple]:
        return bench_models.bench_model(self.model).build()

    def dynamic_shapes(self):
        """torch.export's argument (None: static)."""
        shapes = bench_models.bench_model(self.model).dynamic_shapes
        return shapes() if shapes else None


def rows() -> list[Row]:
    return [
        Row("bert", "static", "hf_bert_static"),
        Row("bert", "dynamic", "hf_bert_dynamic", "8..128 tokens"),
        Row("wav2vec2", "static", "hf_wav2vec2_static"),
        Row("wav2vec2", "dynamic", "hf_wav2vec2_dynamic", "13..100 frames"),
        Row(
            "wav2vec2",
            "dynamic",
            "hf_wav2vec2_dynamic_samples",
            "4,000..32,000 samples",
            profile=True,  # where a program declared in samples spends its time
        ),
        Row("llama", "static", "hf_llama_static"),
        Row("llama", "dynamic", "hf_llama_dynamic", "4..64 tokens"),
        Row("bert_base", "static", "bert_base_4_layers_static"),
        Row("bert_base", "dynamic", "bert_base_4_layers_dynamic", "8..256 tokens"),
        Row("hifigan", "static", "hifigan"),
        Row("hifigan", "dynamic", "hifigan_dynamic", "16..128 frames"),
        Row("mobilenet", "static", "mobilenet_v1_025_static"),
        Row("mobilenet", "dynamic", "mobilenet_v1_025_dynamic", "64..128 px square"),
        Row("lstm", "static", "lstm"),
        Row("lstm", "dynamic", "lstm_dynamic", "8..64 steps"),
    ]


# ---- lowering each runtime's program
def _why(error: BaseException) -> str:
    while error.__cause__ is not None:
        error = error.__cause__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0][:200] if lines else '(no message)'}"


@dataclass
class Side:
    """One runtime's program for a row: how to run it, or why there is none."""

    runs: list[Callable[[], object]] = field(default_factory=list)
    outputs: Callable[[], list] | None = None
    failure: str | None = None
    error: float = float("nan")
    structure: str = ""  # delegates / kernels outside (ExecuTorch sides)
    buffer: bytes | None = None
    peer: onnx_peer.OrtProgram | None = None


def _executorch_side(program, flavour: str, inputs: tuple) -> Side:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
        XnnpackPartitioner as StockPartitioner,
    )

    import etfold.exir
    from etfold.backends.xnnpack import XnnpackPartitioner
    from etfold.harness.llama_export import ops_outside, pte_contents
    from etfold.harness.xnnpack_runner import load_program, lower_xnnpack

    try:
        if flavour == "stock":
            lowered = lower_xnnpack(program, [StockPartitioner()])
        else:
            lowered = lower_xnnpack(  # planned at every length the export declares
                program,
                [XnnpackPartitioner()],
                lower=etfold.exir.to_edge_transform_and_lower,
                keep_declared_bounds=True,
            )
        second = load_program(lowered.executorch)
        outputs = lowered.run(*inputs)  # a run that fails is the lowering's failure too
    except Exception as error:  # a failing lowering is a cell of the table, not its end
        return Side(failure=f"{flavour}: {_why(error)}")
    buffer = lowered.executorch.buffer
    outside = sum(ops_outside(pte_contents(buffer)).values())
    return Side(
        runs=[lambda: lowered.run(*inputs), lambda: second.run_method("forward", inputs)],
        outputs=lambda: outputs,
        structure=f"{lowered.delegates()}/{outside}",
        buffer=buffer,
    )


def _ort_side(program, inputs: tuple) -> Side:
    try:
        peer = onnx_peer.export_to_ort(program, threads=1)
        second = onnx_peer.OrtProgram(peer.model, onnx_peer.ort_session(peer.model), 1)
        outputs = peer.run(*inputs)
    except onnx_peer.PeerExportFailed as error:
        return Side(failure=f"ORT export: {error}")
    except onnx_peer.PeerRunFailed as error:
        return Side(failure=f"ORT run: {error}")
    return Side(
        runs=[peer.runner(inputs), second.runner(inputs)], outputs=lambda: outputs, peer=peer
    )


def lower_row(row: Row) -> tuple[dict[str, Side], tuple, list]:
    from etfold.harness.lowering_speedups import lowering_speedups
    from etfold.harness.xnnpack_runner import eager_outputs, max_abs_error

    module, inputs = row.build()
    dynamic_shapes = row.dynamic_shapes()
    expected = eager_outputs(module, inputs)
    sides: dict[str, Side] = {}
    for flavour in ("stock", "etfold", "ort"):
        try:
            program = torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes)
        except Exception as error:
            sides[flavour] = Side(failure=f"torch.export: {_why(error)}")
            continue
        if flavour == "ort":
            sides[flavour] = _ort_side(program, inputs)
        else:
            with lowering_speedups():
                sides[flavour] = _executorch_side(program, flavour, inputs)
    for side in sides.values():
        if side.outputs is not None:
            try:
                side.error = max_abs_error(side.outputs(), expected)
            except AssertionError as error:  # output count or shapes differ from eager
                side.failure = f"outputs differ from eager: {_why(error)}"
    return sides, inputs, expected


# ---- timing, profiles, text
def _spread(spread: Spread | None, digits: int = 3) -> str:
    if spread is None:
        return "-"
    return f"{spread.median:.{digits}f} ({spread.p10:.{digits}f}-{spread.p90:.{digits}f})"


@dataclass
class Result:
    row: Row
    sides: dict[str, Side]
    ms: dict[str, Spread]
    ratios: dict[tuple[str, str], Spread]


def time_row(row: Row, sides: dict[str, Side], args) -> Result:
    runnable = {f: s.runs for f, s in sides.items() if s.failure is None and s.runs}
    if not runnable:
        return Result(row, sides, {}, {})
    timing = time_interleaved(runnable, budget_s=args.budget, min_rounds=args.runs)
    return Result(row, sides, timing.milliseconds, timing.ratios)


def _ratio(result: Result, base: str, flavour: str) -> Spread | None:
    return result.ratios.get((base, flavour))


def _label(row: Row) -> str:
    return f"{row.shapes} ({row.declared})" if row.declared else row.shapes


def print_row(result: Result) -> None:
    sides, ms = result.sides, result.ms
    cells = []
    for flavour in ("stock", "etfold", "ort"):
        side = sides[flavour]
        if side.failure:
            cells.append(f"{flavour} FAILED {side.failure}")
            continue
        structure = f" [{side.structure}]" if side.structure else ""
        cells.append(f"{flavour} {_spread(ms.get(flavour))} ms{structure} err {side.error:.1e}")
    vs_etfold = _spread(_ratio(result, "etfold", "ort"), 2)
    vs_stock = _spread(_ratio(result, "stock", "ort"), 2)
    print(f"\n{result.row.name} {_label(result.row)}", flush=True)
    for cell in cells:
        print(f"  {cell}")
    print(f"  ORT/etfold {vs_etfold}x, ORT/stock {vs_stock}x", flush=True)


def profile_row(result: Result, inputs: tuple) -> list[str]:
    """Where etfold's time goes against ORT's, by kind of work (see op_profiles)."""
    ours, theirs = result.sides["etfold"], result.sides["ort"]
    et = op_profiles.etdump_op_profile(ours.buffer, inputs)
    ort = onnx_peer.ort_op_profile(theirs.peer, inputs)
    # the timed p10: on a quiet machine the median's neighbour, on a busy one the least
    # preempted rounds (a preempted call lasts several times its work)
    et = op_profiles.with_runtime_overhead(et, result.ms["etfold"].p10)
    ort = op_profiles.with_runtime_overhead(ort, result.ms["ort"].p10)
    lines = [
        f"  profile: per run (timed p10), etfold {et.total_ms:.3f} ms in {et.calls} kernels, "
        f"ORT {ort.total_ms:.3f} ms in {ort.calls}; by kind of work (ms per run, largest "
        "excess first):"
    ]
    return lines + [f"    {line}" for line in op_profiles.gap_lines(et, ort)]


def markdown(results: list[Result]) -> list[str]:
    lines = [
        "| model | shapes | stock ms | etfold ms | ORT ms | ORT/etfold (p10-p90) "
        "| ORT/stock (p10-p90) | delegates/outside stock → etfold |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cells = []
        for flavour in ("stock", "etfold", "ort"):
            side = r.sides[flavour]
            cells.append(
                f"fails ({side.failure[:80]})" if side.failure else f"{r.ms[flavour].median:.3f}"
            )
        structure = f"{r.sides['stock'].structure or '-'} → {r.sides['etfold'].structure or '-'}"
        lines.append(
            f"| {r.row.name} | {_label(r.row)} | {' | '.join(cells)} "
            f"| {_spread(_ratio(r, 'etfold', 'ort'), 2)} | {_spread(_ratio(r, 'stock', 'ort'), 2)} "
            f"| {structure} |"
        )
    return lines


def _profilable(result: Result) -> bool:
    return all(result.sides[f].failure is None for f in ("etfold", "ort"))


def _behind(result: Result) -> bool:
    ratio = _ratio(result, "etfold", "ort")
    return ratio is not None and ratio.median < BEHIND


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    names = list(dict.fromkeys(r.name for r in rows()))
    parser.add_argument("--rows", default=",".join(names), help=", ".join(names))
    parser.add_argument("--budget", type=float, default=4.0, help="timing seconds per row")
    parser.add_argument("--runs", type=int, default=10, help="at least this many rounds")
    parser.add_argument("--no-profile", action="store_true", help="skip the ETDump/ORT profiles")
    parser.add_argument("--markdown", action="store_true", help="end with a markdown table")
    args = parser.parse_args()
    onnx_peer.require()

    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    torch.set_num_threads(1)
    _unsafe_reset_threadpool(1)
    warnings.simplefilter("ignore")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the benches' models
    print(f"{os.cpu_count()} cores; one thread per runtime; {' '.join(sys.argv[1:])}", flush=True)
    wanted = args.rows.split(",")
    results = []
    for row in (r for r in rows() if r.name in wanted):
        sides, inputs, _ = lower_row(row)
        result = time_row(row, sides, args)
        print_row(result)
        if not args.no_profile and (_behind(result) or row.profile) and _profilable(result):
            for line in profile_row(result, inputs):
                print(line, flush=True)
        results.append(result)
    if args.markdown:
        print()
        print("\n".join(markdown(results)))


if __name__ == "__main__":
    main()
