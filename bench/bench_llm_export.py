# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""ExecuTorch's LLM export, stock vs etfold, and small HF models with static and dynamic shapes.

    .venv/bin/python bench/bench_llm_export.py [--layers N] [--modes fp32,8da4w,bf16]
        [--budget SECONDS] [--runs N] [--no-llm] [--no-hf] [--peer ort]

LLM export: `export_llama --model llama3` (ExecuTorch's LLM export, as its docs tell users
to run it) on a SmolLM2-135M-shaped params file (dim 576, 9 heads / 3 KV heads, hidden
1536, vocab 49152, all 30 layers unless `--layers N`) with a seeded random Meta-format
checkpoint written here; `-kv --use_sdpa_with_kv_cache -X --xnnpack-extended-ops
--max_seq_length 128`, plus `-qmode 8da4w --group_size 32` or `-d bf16` for those modes.
Measured on a shared 2-core machine under heavy load (load average 12-17), so latencies are
noisy; structure is exact. `--layers 2 --modes fp32,8da4w --no-hf --budget 4 --runs 5` at
692889b (the 30-layer run did not finish in the time available):
  fp32   delegates 24 -> 19 (11 -> 8.5 per layer + 2); outside 36 -> 15 (etfold: select_copy
         x6 at input_pos, update_cache x4, slice_copy x2, custom_sdpa x2, embedding); prefill
         e/s 1.04 (0.82-1.27), decode 0.91 (0.72-1.07); ETDump outside share prefill 11.9 % ->
         11.2 %, decode 0.9 % -> 0.5 %; export 38.5 -> 23.5 CPU s, peak 1.10 -> 1.17 GB
  8da4w  the same structure; prefill 4.18 / 4.33 ms (linears alone 3.65), e/s 1.04
         (1.00-1.08); decode 2.21 / 2.19 ms (linears alone 2.05), e/s 0.99 (0.95-1.03); ETDump
         outside share prefill 14.5 % -> 7.0 %, decode 5.8 % -> 3.2 %; export 56.4 -> 48.9 CPU s
HF rows: current figures, with their command, in docs/benchmarks.md.

Stock is upstream's `export_llama`; etfold is `etfold.llm_export.export_llama` (the same
pipeline with etfold's partitioners and lowering speed-ups). Each export runs in its own
child process, stock first.

Per mode, stock / etfold:
  delegates      delegate calls in the program, and per layer: (calls - 2) / layers
  outside        kernel calls outside delegates, by op (views, symbolic sizes and scalar
                 arithmetic not counted; their count follows)
  prefill ms     32-token prefill at position 0, median (p10-p90) per call, one thread;
                 stock, etfold and the linears alone timed interleaved; e/s is the per-round
                 ratio etfold/stock (below 1: etfold faster)
  decode ms      one token at position 32, timed the same way
  linears alone  every linear layer of the model once (q, k, v, o, the three MLP ones, and
                 the output head on the last token), on the shapes prefill (decode) gives
                 them, quantized as the mode quantizes them, lowered by stock ExecuTorch:
                 the GEMM work alone, the floor no graph rewrite goes below
  outside share  share of the runtime spent outside delegate calls, from an ETDump of one
                 prefill and one decode (program loaded with `enable_etdump=True`, a warm-up
                 call of each first): sum of OPERATOR_CALL over OPERATOR_CALL + DELEGATE_CALL
  export s       wall seconds of the whole `export_llama` call (checkpoint load, source
                 transforms, torch.export, lowering, serialization), and the child's CPU
                 seconds over it in brackets (what a busy machine does not inflate)
  peak GB        the child's peak RSS over the export call

HF rows (random weights from configs below, one thread): static shape and a dynamic
sequence / time dimension (torch.export.Dim with bounds), stock (upstream entry point and
partitioner) vs etfold (etfold's), delegates / kernel calls outside them (in the .pte,
counted as the LLM rows count them), and the stock/etfold latency ratio (above 1: etfold
faster), median (p10-p90), at the static length. Where stock cannot lower the dynamic
export, etfold's dynamic program is timed against stock's static one, the best stock has.
  bert       BertModel: hidden 128, 2 layers, 4 heads, intermediate 512, vocab 1000;
             64 tokens, dynamic 8..128
  wav2vec2   Wav2Vec2Model: hidden 128, 2 layers, 4 heads, intermediate 512, 7 feature
             convs of 64 channels; 16,000 samples (1 s), dynamic 4,160..32,000 in steps of
             320 (torch.export proves the attention's reshapes only for whole frames)
  llama      LlamaForCausalLM: hidden 128, 2 layers, 4 heads / 2 KV heads, vocab 1000;
             32 tokens, dynamic 4..64
With `--peer ort` (needs `pip install 'etfold[peers]'`), each HF row also runs the same
export on ONNX Runtime (`etfold.harness.onnx_peer`: torch.onnx.export of the
ExportedProgram, one thread, ORT_ENABLE_ALL), timed interleaved with the two, and
prints ORT/etfold and ORT/stock per round. bench/bench_onnx_runtime.py makes the
ONNX Runtime table of docs/benchmarks.md, with more rows and the per-op profiles.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from etfold.harness.bench_models import hf_models
from etfold.harness.llama_export import (
    SMOLLM2_135M,
    LlamaShape,
    export_llama_arguments,
    load_llama,
    ops_outside,
    pte_contents,
    write_model_files,
)
from etfold.harness.timing import Spread, time_interleaved

PRELOAD = ["torch", "executorch.examples.models.llama.export_llama_lib", "etfold.llm_export"]
PREFILL, DECODE_AT, MAX_SEQ_LENGTH = 32, 32, 128
PROMPT = torch.randint(0, 49152, (1, PREFILL), generator=torch.Generator().manual_seed(1))
NEXT = torch.tensor([[11]], dtype=torch.long)


# ---- LLM export: one child per export
def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _child_init() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")


@dataclass(frozen=True)
class Exported:
    pte: str
    seconds: float
    cpu_seconds: float
    peak_kb: int


def export_in_child(flavour: str, arguments: list[str]) -> Exported:
    """One `export_llama` call in this (child) process; peak RSS over the call."""
    from etfold.harness.llama_export import export_etfold, export_stock

    export = export_stock if flavour == "stock" else export_etfold
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    start, cpu = time.perf_counter(), time.process_time()
    buffer = export(arguments)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    pte = arguments[arguments.index("-n") + 1]
    Path(pte).write_bytes(buffer)
    return Exported(pte, seconds, cpu, _rss_kb("VmHWM"))


def export_both(files: tuple[Path, Path], mode: str, workdir: Path) -> dict[str, Exported]:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    exported = {}
    for flavour in ("stock", "etfold"):
        output = workdir / f"{mode}_{flavour}.pte"
        arguments = export_llama_arguments(*files, mode, output, MAX_SEQ_LENGTH)
        with ProcessPoolExecutor(1, mp_context=context, initializer=_child_init) as pool:
            exported[flavour] = pool.submit(export_in_child, flavour, arguments).result()
    return exported


# ---- the floor: the model's linear layers alone
class LinearsAlone(torch.nn.Module):
    """Each linear of the model once, on the input it reads (by slot)."""

    def __init__(self, linears: list[torch.nn.Linear], slots: list[int]):
        super().__init__()
        self.linears, self.slots = torch.nn.ModuleList(linears), slots

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(linear(inputs[s]) for linear, s in zip(self.linears, self.slots, strict=True))


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    return linear


def linears_alone(shape: LlamaShape, checkpoint: Path, tokens: int) -> tuple[LinearsAlone, tuple]:
    """The checkpoint's linears on `tokens` positions (the output head on the last only)."""
    state = torch.load(checkpoint)
    by_input = {"x": [], "attention": [], "hidden": []}
    for layer in range(shape.n_layers):
        prefix = f"layers.{layer}."
        for name in (
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "feed_forward.w1",
            "feed_forward.w3",
        ):
            by_input["x"].append(state[f"{prefix}{name}.weight"])
        by_input["attention"].append(state[f"{prefix}attention.wo.weight"])
        by_input["hidden"].append(state[f"{prefix}feed_forward.w2.weight"])
    generator = torch.Generator().manual_seed(0)
    inputs = (
        torch.randn(1, tokens, shape.dim, generator=generator),
        torch.randn(1, tokens, shape.n_heads * shape.head_dim, generator=generator),
        torch.randn(1, tokens, shape.hidden_dim, generator=generator),
        torch.randn(1, 1, shape.dim, generator=generator),
    )
    weights, slots = [], []
    for slot, key in enumerate(("x", "attention", "hidden")):
        weights += by_input[key]
        slots += [slot] * len(by_input[key])
    weights.append(state["output.weight"])
    slots.append(3)
    return LinearsAlone([_linear(w) for w in weights], slots).eval(), inputs


def lower_linears_alone(shape: LlamaShape, checkpoint: Path, mode: str, tokens: int):
    """The linears, quantized by export_llama's own source transform for 8da4w, in bf16 for
    bf16, lowered with stock's partitioners as export_llama asks for them."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
        XnnpackDynamicallyQuantizedPartitioner,
        XnnpackPartitioner,
    )
    from executorch.exir import to_edge_transform_and_lower

    module, inputs = linears_alone(shape, checkpoint, tokens)
    bf16 = mode == "bf16"
    if bf16:
        module, inputs = module.to(torch.bfloat16), tuple(i.to(torch.bfloat16) for i in inputs)
    if mode == "8da4w":
        from executorch.examples.models.llama.source_transformation.quantize import quantize

        module = quantize(module, qmode="8da4w", group_size=32)
    partitioners = [
        XnnpackDynamicallyQuantizedPartitioner(enable_bf16=bf16),
        XnnpackPartitioner(enable_bf16=bf16),
    ]
    program = torch.export.export(module, inputs)
    edge = to_edge_transform_and_lower(program, partitioner=partitioners)
    return edge.to_executorch().buffer, inputs


# ---- runtime
def _run_llama(buffer: bytes, tokens: torch.Tensor, position: int):
    llama = load_llama(buffer)
    llama.step(PROMPT, 0)  # the cache holds the prompt before a decode step
    return lambda: llama.step(tokens, position)


def _run_program(buffer: bytes, inputs: tuple):
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(buffer)
    method = program.load_method("forward")
    return lambda: (program, method.execute(inputs))


def time_phase(programs: dict[str, bytes], floor: tuple[bytes, tuple], tokens, position, args):
    runs = {
        name: [_run_llama(buffer, tokens, position) for _ in range(2)]
        for name, buffer in programs.items()
    }
    runs["linears"] = [_run_program(*floor) for _ in range(2)]
    return time_interleaved(runs, budget_s=args.budget, min_rounds=args.runs)


def etdump_outside_share(buffer: bytes, workdir: Path) -> tuple[float, float]:
    """(prefill, decode) share of time outside delegate calls, from one ETDump."""
    from executorch.devtools import Inspector

    llama = load_llama(buffer, enable_etdump=True)
    for _ in range(2):  # warm-up pair, then the measured pair
        llama.step(PROMPT, 0)
        llama.step(NEXT, DECODE_AT)
    etdump, debug = workdir / "run.etdp", workdir / "run.bin"
    llama.program.write_etdump_result_to_file(str(etdump), str(debug))
    inspector = Inspector(etdump_path=str(etdump))
    totals = {"OPERATOR_CALL": [0.0] * 4, "DELEGATE_CALL": [0.0] * 4}
    for block in inspector.event_blocks:
        for event in block.events:
            if event.name in totals and event.perf_data is not None:
                for run, ms in enumerate(event.perf_data.raw[:4]):
                    totals[event.name][run] += ms
    share = [
        totals["OPERATOR_CALL"][run] / (totals["OPERATOR_CALL"][run] + totals["DELEGATE_CALL"][run])
        for run in (2, 3)
    ]
    return share[0], share[1]


# ---- LLM report
def _spread(spread: Spread, digits: int = 2) -> str:
    return f"{spread.median:.{digits}f} ({spread.p10:.{digits}f}-{spread.p90:.{digits}f})"


def _outside_text(counts: Counter[str]) -> str:
    shown = [f"{op.split('::')[-1]} x{n}" for op, n in counts.most_common()]
    return ", ".join(shown) or "-"


def llm_rows(args, workdir: Path) -> None:
    shape = LlamaShape(**{**SMOLLM2_135M.__dict__, "n_layers": args.layers})
    files = write_model_files(shape, workdir / "model")
    for mode in args.modes:
        started = time.perf_counter()
        exported = export_both(files, mode, workdir)
        programs = {name: Path(e.pte).read_bytes() for name, e in exported.items()}
        print(f"\n== export_llama {mode}, {args.layers} layers (SmolLM2-135M shape)", flush=True)
        for name, buffer in programs.items():
            contents, e = pte_contents(buffer), exported[name]
            counted = ops_outside(contents)
            bookkeeping = sum(ops_outside(contents, bookkeeping=True).values()) - sum(
                counted.values()
            )
            per_layer = (contents.delegate_calls - 2) / args.layers
            print(
                f"{name:6} delegates {contents.delegate_calls} ({per_layer:.2f} per layer + 2); "
                f"outside {sum(counted.values())}: {_outside_text(counted)}; "
                f"+{bookkeeping} view/size/scalar; export {e.seconds:.1f} s "
                f"({e.cpu_seconds:.1f} CPU s), peak {e.peak_kb / 2**20:.2f} GB",
                flush=True,
            )
        for label, tokens, position in (("prefill", PROMPT, 0), ("decode", NEXT, DECODE_AT)):
            floor = lower_linears_alone(shape, files[1], mode, tokens.shape[1])
            timing = time_phase(programs, floor, tokens, position, args)
            ms = timing.milliseconds
            ratio = timing.ratios[("stock", "etfold")]
            print(
                f"{label:7} ms: stock {_spread(ms['stock'])}, etfold {_spread(ms['etfold'])}, "
                f"linears alone {_spread(ms['linears'])}; e/s {_spread(ratio, 3)} "
                f"({timing.rounds} rounds x {timing.inner})",
                flush=True,
            )
        for name, buffer in programs.items():
            prefill, decode = etdump_outside_share(buffer, workdir)
            print(
                f"{name:6} outside delegates (ETDump): prefill {prefill:.1%}, decode {decode:.1%}"
            )
        print(f"({time.perf_counter() - started:.0f} s for this mode)", flush=True)


# ---- HF rows
def _kernels_outside(program) -> int:
    """Kernel calls outside delegates in the serialized program, counted as the LLM rows
    count them (views, symbolic sizes and scalar arithmetic left out)."""
    return sum(ops_outside(pte_contents(program.executorch.buffer)).values())


def _time_pair(stock, ours, inputs: tuple, args, peer=None):
    runs = {"etfold": lambda: ours.run(*inputs), "stock": lambda: stock.run(*inputs)}
    if peer is not None:
        runs["ort"] = peer.runner(inputs)
    return time_interleaved(runs, budget_s=args.budget / 2, min_rounds=args.runs)


def _ort_or_failure(module, inputs: tuple, dynamic):
    """ONNX Runtime's program for the same export, or why there is none (ORT's failure)."""
    from etfold.harness import onnx_peer

    try:
        program = torch.export.export(module, inputs, dynamic_shapes=dynamic)
        return onnx_peer.export_to_ort(program, threads=1)
    except onnx_peer.PeerExportFailed as error:
        return f"ORT export: {error}"
    except onnx_peer.PeerRunFailed as error:
        return f"ORT run: {error}"


def _peer_text(timing, peer, inputs: tuple, expected) -> str:
    from etfold.harness.xnnpack_runner import max_abs_error

    if isinstance(peer, str):
        return f"; {peer}"
    error = max_abs_error(peer.run(*inputs), expected)
    vs_etfold, vs_stock = timing.ratios[("etfold", "ort")], timing.ratios[("stock", "ort")]
    return f"; ORT/etfold {_spread(vs_etfold)}x, ORT/stock {_spread(vs_stock)}x (ORT error {error:.1e})"


def _lowered_or_failure(program, partitioner, **lowering):
    """The lowered program, or the first line of the error that stopped it."""
    from etfold.harness.xnnpack_runner import lower_xnnpack

    try:
        return lower_xnnpack(program, [partitioner], **lowering)
    except Exception as error:  # a stock failure is a row of the table, not the end of it
        return f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"


def hf_rows(args) -> None:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
        XnnpackPartitioner as StockPartitioner,
    )

    import etfold.exir
    from etfold.backends.xnnpack import XnnpackPartitioner
    from etfold.harness.xnnpack_runner import eager_outputs, max_abs_error

    print("\n== HF models: delegates / ops outside, stock -> etfold; stock/etfold latency")
    for name, (module, inputs, dim) in hf_models().items():
        expected = eager_outputs(module, inputs)
        static_stock = None
        for shapes in ("static", "dynamic"):
            dynamic = None if shapes == "static" else ({1: dim},)
            program = torch.export.export(module, inputs, dynamic_shapes=dynamic)
            # etfold's first: stock's to_executorch narrows the length's range in the shape
            # environment both share, which etfold would refuse
            ours = _lowered_or_failure(
                program,
                XnnpackPartitioner(),
                lower=etfold.exir.to_edge_transform_and_lower,
                keep_declared_bounds=True,
            )
            lowered = {"stock": _lowered_or_failure(program, StockPartitioner()), "etfold": ours}
            failed = {f: r for f, r in lowered.items() if isinstance(r, str)}
            if failed:
                reasons = "; ".join(f"{f} fails to lower: {r}" for f, r in failed.items())
                if "etfold" not in failed:
                    ours = lowered["etfold"]
                    reasons += (
                        f"; etfold {ours.delegates()}/{_kernels_outside(ours)}, max error vs eager "
                        f"{max_abs_error(ours.run(*inputs), expected):.1e}"
                    )
                    if static_stock is not None:  # stock's best: its static program
                        peer = _ort_or_failure(module, inputs, dynamic) if args.peer else None
                        timed_peer = None if isinstance(peer, str) else peer
                        timing = _time_pair(static_stock, ours, inputs, args, timed_peer)
                        ratio = _spread(timing.ratios[("etfold", "stock")])
                        reasons += f"; stock's static program/etfold's dynamic one {ratio}x"
                        if args.peer:
                            reasons += _peer_text(timing, peer, inputs, expected)
                print(f"{name:8} {shapes:7} {reasons}", flush=True)
                continue
            stock, ours = lowered["stock"], lowered["etfold"]
            static_stock = stock if shapes == "static" else static_stock
            error = max(max_abs_error(p.run(*inputs), expected) for p in (stock, ours))
            peer = _ort_or_failure(module, inputs, dynamic) if args.peer else None
            timed_peer = None if isinstance(peer, str) else peer
            timing = _time_pair(stock, ours, inputs, args, timed_peer)
            print(
                f"{name:8} {shapes:7} {stock.delegates()}/{_kernels_outside(stock)} -> "
                f"{ours.delegates()}/{_kernels_outside(ours)}, "
                f"stock/etfold {_spread(timing.ratios[('etfold', 'stock')])}x "
                f"(max error vs eager {error:.1e})"
                + (_peer_text(timing, peer, inputs, expected) if args.peer else ""),
                flush=True,
            )


def _commit() -> str:
    root = Path(__file__).resolve().parent.parent
    described = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    )
    return described.stdout.strip() + (
        " (with uncommitted changes)" if dirty.stdout.strip() else ""
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=SMOLLM2_135M.n_layers)
    parser.add_argument("--modes", default="fp32,8da4w", type=lambda s: s.split(","))
    parser.add_argument("--budget", type=float, default=6.0, help="seconds of timing per phase")
    parser.add_argument("--runs", type=int, default=5, help="at least this many rounds")
    parser.add_argument("--no-llm", action="store_true")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument(
        "--peer", choices=["ort"], help="HF rows: also time ONNX Runtime on the same export"
    )
    args = parser.parse_args()
    if args.peer:
        from etfold.harness import onnx_peer

        onnx_peer.require()

    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    torch.set_num_threads(1)
    _unsafe_reset_threadpool(1)
    warnings.simplefilter("ignore")
    print(f"etfold at {_commit()}; {os.cpu_count()} cores; {' '.join(sys.argv[1:])}")
    with tempfile.TemporaryDirectory() as workdir:
        if not args.no_llm:
            llm_rows(args, Path(workdir))
        if not args.no_hf:
            from etfold.harness.lowering_speedups import lowering_speedups

            with lowering_speedups():
                hf_rows(args)


if __name__ == "__main__":
    main()
