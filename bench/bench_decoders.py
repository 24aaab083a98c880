# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Production-size models on XNNPACK: stock ExecuTorch vs etfold, lowering cost and runtime.

    .venv/bin/python bench/bench_decoders.py [--models smollm2_360m,wav2vec2_large,...]
        [--dtypes bf16,fp32] [--layers N|full] [--runs N] [--budget SECONDS]

Every model runs in every dtype it takes (smollm2_360m in bf16 and fp32, wav2vec2_large in
fp32; fp16 on request: `--dtypes bf16,fp32,fp16`), with `--layers` transformer layers: 4 by
default, `--layers 2` for the quick run, `--layers full` for the models' own 32 and 24.
Why 4: the lowering, not the runtime, sets the cost. Full size, one row at a time on an
AVX2-only 2-core machine (`--models smollm2_360m --dtypes fp32 --layers full --budget 10`,
and the same with `--dtypes bf16`, quiet; at f0e020b):
  smollm2_360m fp32: stock 164 delegates and 778 ops outside, etfold 2 and 2 (the
  embedding and the returned alias); 321.6 vs 303.6 ms per call (e/s 0.96, 0.86-1.08),
  the linears alone 296.8 ms, eager 616.6 ms; lowering 220 vs 149 CPU s; peak RSS 5.44
  vs 5.26 GB; the row took 8 min 25 s.
  smollm2_360m bf16: stock 420 and 1,135, etfold 2 and 2; 336.5 vs 297.3 ms (e/s 0.86,
  0.81-0.93), the linears alone 274.5 ms, eager bf16 292.1 ms; lowering 405 vs 161 CPU s;
  3.70 vs 3.44 GB; 11 min 13 s.
  smollm2_360m fp16 (`--dtypes fp16 --budget 6 --runs 3`, at a6dc530): stock 420 and
  1,135, etfold 2 and 2; 430.3 vs 396.8 ms (e/s 0.88, 0.84-0.95), the linears alone
  352.9 ms, eager fp16 1,646.0 ms; lowering 447 vs 176 CPU s; 3.79 vs 3.39 GB; error
  against eager fp16 0.0083 vs 0.0081; 12 min 45 s.
  (`--models wav2vec2_large --dtypes fp32 --layers full --budget 10`, at 6449898)
  wav2vec2_large fp32: stock 106 delegates and 428 ops outside, etfold 1 and 0; 1,284.8
  vs 426.2 ms (e/s 0.33, 0.28-0.38); lowering 103.2 vs 98.9 CPU s (0.96x); 4.06 vs 4.13
  GB; 4 min 36 s.
So etfold's full-size decoder takes 2 % (fp32), 8 % (bf16) and 12 % (fp16) longer than
its linears alone: no graph rewrite can make it much faster (a faster GEMM, or fewer multiply-adds,
would). The default run took 6 min 45 s wall beside another job
(lowerings 37-54 CPU s each), the `--layers 2` run 7 min 14 s beside a heavier one. Ops
outside and delegates repeat per layer, so a few layers show every pattern a full-size
model has; latency, lowering time and RSS grow with the count.

Models (random weights, seeded; configs in etfold/harness/bench_models.py, nothing downloaded):
  smollm2_360m    transformers Llama with SmolLM2-360M's shape: 32 layers, hidden 960,
                  intermediate 2560, 15 heads / 5 KV heads, vocab 49152, rope_theta 1e5,
                  tied embeddings, sdpa; `input_ids (1, 32) -> logits`, no KV cache
  wav2vec2_large  transformers Wav2Vec2Model with wav2vec2-large-lv60's shape: hidden 1024,
                  24 layers, 16 heads, intermediate 4096, 7-conv layer-norm feature
                  extractor, stable layer norm, weight_norm positional conv (kernel 128,
                  16 groups); 1 s of 16 kHz audio -> last hidden state; fp32 only
  encoders, on request (`--models bert_base,vit_base,whisper_base_encoder`), each -> its
  last hidden state, sdpa attention, every dtype:
  bert_base       BertModel with bert-base's shape: 12 layers, hidden 768, 12 heads,
                  intermediate 3072, vocab 30522; 128 token ids, no padding mask
  vit_base        ViTModel with vit-base-patch16-224's shape: 12 layers, hidden 768,
                  12 heads; one 224x224 image (197 tokens)
  whisper_base_encoder  Whisper-base's encoder: 6 layers, d_model 512, 8 heads, ffn 2048,
                  two convs over 80 mel bins; 30 s of features (1500 tokens)
  Full size in fp32 (`--models bert_base,vit_base,whisper_base_encoder --dtypes fp32
  --layers full --budget 6 --runs 3`, at bd06405, 6 min 46 s): each etfold program is one
  delegate with nothing outside but BERT's token lookup (stock: 49, 49 and 25 delegates,
  219, 213 and 87 ops outside); per call stock / etfold / linears alone: BERT 261.5 /
  235.5 / 233.2 ms, ViT 463.4 / 377.1 / 348.1 ms, Whisper 2,372.7 / 980.8 / 558.2 ms;
  lowering 47.0 / 50.4, 41.3 / 44.7 and 22.1 / 24.3 CPU s (etfold 7-10 % slower).
  At 2 layers (`--models bert_base,vit_base,whisper_base_encoder --dtypes fp32,bf16
  --layers 2 --budget 3 --runs 3`, at 528e1ea): in fp32 each is one delegate, with only
  BERT's token lookup outside (stock: 9 delegates, 31-49 ops outside); in bf16 stock's
  ViT and Whisper programs fail to load (a bf16 conv delegate), etfold's load, with the
  stem convs outside where the weight fold's growth budget declines their fp32 weights.

Stock: upstream `executorch.exir.to_edge_transform_and_lower` with upstream
`XnnpackPartitioner`; etfold: `etfold.exir.to_edge_transform_and_lower` with etfold's
`XnnpackPartitioner`; both with `enable_bf16=True` for bf16 rows. Each lowering runs in
its own child process (forkserver, torch and ExecuTorch preloaded, one at a time), which
builds and exports the model, resets its peak RSS (`5 > /proc/self/clear_refs`), lowers,
and reads VmHWM from /proc/self/status.

Columns (stock / etfold in each):
  delegates        XNNPACK delegate calls in the lowered program
  outside          ops left outside delegates (memory-planning `alloc` not counted); the
                   top ones by name on the line below
  runtime ms       median per call on the XNNPACK runtime (one thread), stock, etfold and
                   eager torch (one thread) timed interleaved in this process, for
                   --budget seconds and at least --runs rounds
  e/s              etfold/stock runtime ratio per round: median (p10-p90)
  linears alone    (on the line below the row) every nn.Linear of the model once, on
                   inputs of the shapes it reads in the model, lowered by stock ExecuTorch
                   and timed interleaved with the others: the GEMM work alone, the floor
                   under the model's latency that no graph rewrite goes below
  lower s (cpu)    wall seconds of to_edge_transform_and_lower + to_executorch (export
                   excluded), and in brackets the child's CPU seconds over the same span (what
                   a busy machine does not inflate); one lowering per flavour, a single pair
  peak GB          the child's peak RSS from the start of lowering to the .pte bytes, and in
                   brackets its growth over the RSS when lowering started (model + export)
  err dtype        max |runtime - eager| against eager in the model's dtype
  err fp32         max |runtime - eager| against eager of the same weights in fp32
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
import warnings
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from etfold.harness.bench_models import DECODERS, in_dtype
from etfold.harness.bench_models import decoder_in_dtype as build
from etfold.harness.timing import time_interleaved
from etfold.harness.xnnpack_runner import eager_outputs, max_abs_error

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRELOAD = ["torch", "transformers", "executorch.exir", "etfold.exir", "etfold.backends.xnnpack"]


MODELS = DECODERS
FP32_ONLY = {"wav2vec2_large"}


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _child_init() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)  # pytree deprecations, once per pickle


@dataclass(frozen=True)
class Lowered:
    """What one lowering child reports."""

    pte: str
    delegates: int
    outside: dict[str, int]
    seconds: float
    cpu_seconds: float
    peak_kb: int
    start_kb: int


def lower_in_child(flavour: str, model: str, dtype_name: str, layers: int, pte: str) -> Lowered:
    """Build, export, lower and serialize in this (child) process; peak RSS from lowering on."""
    from etfold.harness.inspection import delegate_count, ops_outside_delegates

    module, inputs = build(model, DTYPES[dtype_name], layers)
    program = torch.export.export(module, inputs)
    lower, partitioner = _flavour(flavour, dtype_name)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    start_kb = _rss_kb("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    edge = lower(program, partitioner=[partitioner])
    graph = edge.exported_program()
    delegates, outside = delegate_count(graph), ops_outside_delegates(graph)
    buffer = edge.to_executorch().buffer
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak_kb = _rss_kb("VmHWM")
    Path(pte).write_bytes(buffer)
    return Lowered(pte, delegates, dict(outside), seconds, cpu, peak_kb, start_kb)


def _flavour(flavour: str, dtype_name: str):
    """(entry point, partitioner) of a flavour, as shipped."""
    kwargs = {"enable_bf16": True} if dtype_name == "bf16" else {}
    if flavour == "stock":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower
    else:
        from etfold.backends.xnnpack import XnnpackPartitioner
        from etfold.exir import to_edge_transform_and_lower
    return to_edge_transform_and_lower, XnnpackPartitioner(**kwargs)


def lower_both(model: str, dtype_name: str, layers: int, workdir: str) -> dict[str, Lowered]:
    """Stock then etfold, each in a fresh child, never two at once."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    lowered = {}
    for flavour in ("stock", "etfold"):
        pte = str(Path(workdir) / f"{model}_{dtype_name}_{flavour}.pte")
        with ProcessPoolExecutor(1, mp_context=context, initializer=_child_init) as pool:
            lowered[flavour] = pool.submit(
                lower_in_child, flavour, model, dtype_name, layers, pte
            ).result()
    return lowered


@dataclass
class Loaded:
    """A .pte on the wheel's runtime; the method keeps a pointer into the program."""

    program: object
    method: object

    def run(self, inputs: tuple) -> list[torch.Tensor]:
        return list(self.method.execute(inputs))


def load(pte: str) -> Loaded:
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(pte)
    return Loaded(program, program.load_method("forward"))


def references(model: str, dtype: torch.dtype, layers: int):
    """(module in dtype, inputs, eager outputs in dtype, eager outputs in fp32)."""
    module, inputs = build(model, torch.float32, layers)
    fp32 = eager_outputs(module, inputs)
    module, inputs = module.to(dtype), in_dtype(inputs, dtype)
    return module, inputs, eager_outputs(module, inputs), fp32


class LinearsAlone(torch.nn.Module):
    """Each `nn.Linear` of a model applied once to an input of the shape it sees in the
    model's forward: the model's GEMM work with nothing around it."""

    def __init__(self, linears: list[torch.nn.Linear], slots: list[int]):
        super().__init__()
        self.linears, self.slots = torch.nn.ModuleList(linears), slots

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(
            linear(inputs[slot]) for linear, slot in zip(self.linears, self.slots, strict=True)
        )


def linears_alone(module: torch.nn.Module, inputs: tuple) -> tuple[LinearsAlone, tuple]:
    """The model's linears and one random input per shape they read, recorded by hooks
    during one eager call (the weights are the model's own)."""
    seen = []
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    hooks = [m.register_forward_hook(lambda m, a, _: seen.append((m, a[0]))) for m in linears]
    try:
        with torch.no_grad():
            module(*inputs)
    finally:
        for hook in hooks:
            hook.remove()
    shapes = sorted({(tuple(x.shape), x.dtype) for _, x in seen}, key=str)
    generator = torch.Generator().manual_seed(0)
    arguments = tuple(torch.randn(shape, generator=generator).to(dtype) for shape, dtype in shapes)
    slots = [shapes.index((tuple(x.shape), x.dtype)) for _, x in seen]
    return LinearsAlone([m for m, _ in seen], slots).eval(), arguments


def lower_linears_alone(module, inputs, dtype_name: str, pte: str):
    """`linears_alone(module)` lowered by stock ExecuTorch and loaded, with its inputs."""
    alone, arguments = linears_alone(module, inputs)
    lower, partitioner = _flavour("stock", dtype_name)
    program = lower(torch.export.export(alone, arguments), partitioner=[partitioner])
    Path(pte).write_bytes(program.to_executorch().buffer)
    return load(pte), arguments


def _errors(outputs: list[torch.Tensor], in_dtype: list, fp32: list) -> tuple[float, float]:
    return max_abs_error(outputs, in_dtype), max_abs_error([o.float() for o in outputs], fp32)


def _eager_call(module: torch.nn.Module, inputs: tuple):
    def call():
        with torch.inference_mode():
            module(*inputs)

    return call


def _outside(outside: dict[str, int]) -> Counter[str]:
    """Ops outside delegates, memory-planning `alloc` not counted."""
    return Counter({op: n for op, n in outside.items() if op != "alloc"})


def _top_ops(outside: dict[str, int], top: int) -> str:
    counts = _outside(outside)
    shown = [f"{op.removeprefix('aten.')} x{n}" for op, n in counts.most_common(top)]
    rest = sum(counts.values()) - sum(n for _, n in counts.most_common(top))
    return ", ".join(shown + ([f"+{rest} more"] if rest else [])) or "-"


def _pair(stock, etfold, spec: str) -> str:
    return f"{stock:{spec}} / {etfold:{spec}}"


HEADER = (
    f"{'model':14} {'dtype':5} | {'delegates':>9} | {'outside':>9} | "
    f"{'runtime ms s / e / eager':>26} | {'e/s (p10-p90)':>17} | {'lower s (cpu)':>29} | "
    f"{'peak GB (+growth)':>27} | {'err dtype':>17} | {'err fp32':>17}"
)


def bench_row(model: str, dtype_name: str, args, workdir: str) -> str:
    """One model in one dtype: lower both flavours in children, then check and time here."""
    lowered = lower_both(model, dtype_name, args.layers, workdir)
    module, inputs, in_dtype, fp32 = references(model, DTYPES[dtype_name], args.layers)
    loaded, failed = {}, {}
    for flavour, row in lowered.items():
        try:
            loaded[flavour] = load(row.pte)
        except RuntimeError as error:  # e.g. a delegate XNNPACK cannot compile at load time
            failed[flavour] = str(error)
    if failed:
        return _unloadable_row(model, dtype_name, lowered, failed, args)
    errors = {flavour: _errors(p.run(inputs), in_dtype, fp32) for flavour, p in loaded.items()}
    runs = {flavour: (lambda p=p: p.run(inputs)) for flavour, p in loaded.items()}
    pte = str(Path(workdir) / f"{model}_{dtype_name}_linears.pte")
    linears, arguments = lower_linears_alone(module, inputs, dtype_name, pte)
    timing = time_interleaved(
        {**runs, "eager": _eager_call(module, inputs), "linears": lambda: linears.run(arguments)},
        budget_s=args.budget,
        min_rounds=args.runs,
        warmup=1,
    )
    scale = (
        f"({timing.rounds} rounds; |eager fp32| max {_max_abs(fp32):.3g}; the model's linears "
        f"alone on stock XNNPACK {timing.milliseconds['linears'].median:.1f} ms)"
    )
    return _row_lines(model, dtype_name, _cells(lowered, errors, timing), lowered, args, scale)


_INDENT = " " * 21


def _row_lines(model: str, dtype_name: str, cells: str, lowered: dict, args, last: str) -> str:
    """The row's cells, the ops outside by name for each flavour, and a closing line."""
    s, e = lowered["stock"], lowered["etfold"]
    outside = (
        f"outside, stock: {_top_ops(s.outside, args.top)}; etfold: {_top_ops(e.outside, args.top)}"
    )
    return "\n".join([f"{model:14} {dtype_name:5} | {cells}", _INDENT + outside, _INDENT + last])


def _unloadable_row(model: str, dtype_name: str, lowered: dict, failed: dict, args) -> str:
    """Counts and lowering cost only: a flavour whose program the runtime refuses to load."""
    delegates, outside, lowering = _lowering_cells(lowered)
    cells = f"{delegates} | {outside} | {lowering} (delegates | outside | lower s)"
    refused = "; ".join(f"{flavour} fails to load: {error}" for flavour, error in failed.items())
    return _row_lines(model, dtype_name, cells, lowered, args, refused + " (not timed)")


def _lowering_cells(lowered: dict[str, Lowered]) -> tuple[str, str, str]:
    """Delegates, ops outside and lowering seconds, stock / etfold."""
    s, e = lowered["stock"], lowered["etfold"]
    return (
        _pair(s.delegates, e.delegates, ">3"),
        _pair(_outside(s.outside).total(), _outside(e.outside).total(), ">3"),
        " / ".join(f"{r.seconds:5.1f} ({r.cpu_seconds:5.1f})" for r in (s, e)),
    )


def _cells(lowered: dict[str, Lowered], errors: dict, timing) -> str:
    """The columns after model and dtype."""
    ms, ratio = timing.milliseconds, timing.ratios[("stock", "etfold")]
    gb = {f: (r.peak_kb / 2**20, (r.peak_kb - r.start_kb) / 2**20) for f, r in lowered.items()}
    delegates, outside, lowering = _lowering_cells(lowered)
    return " | ".join(
        [
            delegates,
            outside,
            f"{ms['stock'].median:8.1f} / {ms['etfold'].median:6.1f} / {ms['eager'].median:6.1f}",
            f"{ratio.median:5.2f} ({ratio.p10:.2f}-{ratio.p90:.2f})",
            lowering,
            " / ".join(f"{gb[f][0]:5.2f} ({gb[f][1]:+.2f})" for f in ("stock", "etfold")),
            _pair(errors["stock"][0], errors["etfold"][0], "7.2g"),
            _pair(errors["stock"][1], errors["etfold"][1], "7.2g"),
        ]
    )


def _max_abs(outputs: list[torch.Tensor]) -> float:
    return max(float(o.abs().max()) for o in outputs)


def _rows(args) -> list[tuple[str, str]]:
    """(model, dtype) pairs asked for; fp32-only models skip the other dtypes."""
    return [
        (model, dtype)
        for model in args.models.split(",")
        for dtype in args.dtypes.split(",")
        if dtype == "fp32" or model not in FP32_ONLY
    ]


def _layer_count(text: str) -> int:
    """`full` (0: each model's own count) or a positive layer count."""
    if text == "full":
        return 0
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive layer count or `full`, got {text!r}")
    return int(text)


def main() -> None:
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2_360m,wav2vec2_large", help=", ".join(MODELS))
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument(
        "--layers", type=_layer_count, default=4, help="transformer layers, or `full`"
    )
    parser.add_argument("--runs", type=int, default=5, help="at least this many timing rounds")
    parser.add_argument("--budget", type=float, default=10.0, help="timing seconds per row")
    parser.add_argument("--top", type=int, default=4, help="ops outside named per flavour")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _unsafe_reset_threadpool(1)  # single-threaded runtime: ratios independent of core count
    layers = f"{args.layers} layers" if args.layers else "full size"
    print(f"stock / etfold in each column ({layers}); e/s = etfold/stock runtime per round")
    print(HEADER)
    print("-" * len(HEADER))
    with tempfile.TemporaryDirectory(prefix="bench_decoders_") as workdir:
        for model, dtype_name in _rows(args):
            start = time.perf_counter()
            print(bench_row(model, dtype_name, args, workdir), flush=True)
            print(f"{_INDENT}(row wall time {time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
