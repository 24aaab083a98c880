# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Where a program's time goes, per op, on ExecuTorch (ETDump) and ONNX Runtime (its profiler),
and the gap between the two by kind of work.

ExecuTorch: the program is loaded with `enable_etdump=True` and run; the Inspector's
events give each XNNPACK operator inside a delegate (`Fully Connected (NC, F32) GEMM
#3`: the delegate's own per-operator profile), each kernel outside delegates
(`native_call_<op>`). Each event counts with its typical time over the profiled runs
(`onnx_peer.typical`).

Both profilers cost time of their own between kernels (ORT's most of a run on a
small model), so what a runtime spends outside its kernels, `runtime overhead`
(delegate calls, XNNPACK's reshape and setup per call, input and output copies,
ORT's session bookkeeping), is an unprofiled timing's median minus the profiled
kernels.

The two runtimes name different ops, so the comparison is by kind of work
(`KINDS`): a GEMM is a GEMM whichever runtime runs it. Kinds say whether a graph
rewrite can move the time: work a rewrite removes or fuses (ops outside delegates,
layout copies, overhead per op) versus the same arithmetic on both sides, where a
gap is the kernels'.
"""

from __future__ import annotations

import re
import statistics
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from etfold.harness.onnx_peer import OpProfile, typical

OUTSIDE = "ops outside delegates"
RUNTIME_OVERHEAD = "runtime overhead"


@dataclass(frozen=True)
class Kind:
    name: str
    executorch: tuple[str, ...]  # lower-case fragments of XNNPACK operator names
    ort: tuple[str, ...]  # ONNX op types (exact)
    by_rewrite: bool  # whether a graph rewrite can remove this kind of time


# first match wins: "batch matrix multiply" is a GEMM, not an elementwise multiply
KINDS = (
    Kind(  # one kind: XNNPACK runs a 1x1 conv as a fully connected GEMM, ORT as a Conv
        "GEMM: matmul, linear, conv",
        ("convolution", "fully connected", "matrix multiply", "gemm"),
        (
            *("MatMul", "Gemm", "FusedMatMul", "FusedGemm", "MatMulNBits", "MatMulInteger"),
            *("Conv", "FusedConv", "ConvTranspose", "NhwcConv"),
        ),
        False,
    ),
    Kind(
        "attention",
        ("scaled dot product",),
        ("Attention", "MultiHeadAttention", "GroupQueryAttention"),
        False,
    ),
    Kind("softmax", ("softmax",), ("Softmax", "LogSoftmax"), False),
    Kind(
        "normalization",
        ("normaliz", "layer_norm", "group_norm", "batch_norm", "rms"),
        (
            "LayerNormalization",
            "SkipLayerNormalization",
            "SimplifiedLayerNormalization",
            "SkipSimplifiedLayerNormalization",
            "BatchNormalization",
            "GroupNormalization",
            "InstanceNormalization",
            "RMSNormalization",
        ),
        False,
    ),
    Kind("recurrent cell", (), ("LSTM", "GRU", "RNN"), False),
    Kind(
        "reductions / pooling",
        ("mean", "sum", "pooling", "reduce", "max (nd"),
        (
            "ReduceMean",
            "ReduceSum",
            "ReduceMax",
            "GlobalAveragePool",
            "AveragePool",
            "MaxPool",
            "GlobalMaxPool",
        ),
        False,
    ),
    Kind(
        "layout / copies",
        ("transpose", "copy", "concatenate", "slice", "pad", "reshape", "split", "convert"),
        (
            "Transpose",
            "Reshape",
            "Concat",
            "Slice",
            "Split",
            "Gather",
            "Expand",
            "Squeeze",
            "Unsqueeze",
            "Shape",
            "Pad",
            "Identity",
            "ConstantOfShape",
            "Range",
            "Tile",
            "Cast",
            "Flatten",
            "ReorderInput",
            "ReorderOutput",
        ),
        True,
    ),
    Kind(
        "elementwise / activations",
        (
            "add",
            "multiply",
            "subtract",
            "divide",
            "gelu",
            "sigmoid",
            "tanh",
            "clamp",
            "exp",
            "square",
            "reciprocal",
            "negate",
            "abs",
            "hardswish",
            "leaky",
            "maximum",
            "minimum",
            "elu",
            "log",
            "sin",
            "cos",
        ),
        (
            "Add",
            "Mul",
            "Sub",
            "Div",
            "Gelu",
            "FastGelu",
            "BiasGelu",
            "QuickGelu",
            "Sigmoid",
            "Tanh",
            "Relu",
            "Clip",
            "Erf",
            "Sqrt",
            "Pow",
            "Neg",
            "Where",
            "Exp",
            "Reciprocal",
            "Max",
            "Min",
            "LeakyRelu",
            "HardSigmoid",
            "HardSwish",
            "Sin",
            "Cos",
            "Equal",
            "Less",
            "Greater",
            "Not",
            "And",
            "Or",
        ),
        True,
    ),
)
_BY_REWRITE = {k.name: k.by_rewrite for k in KINDS} | {
    OUTSIDE: True,
    RUNTIME_OVERHEAD: False,
    "other": False,
}


def executorch_kind(name: str) -> str:
    """The kind of an ETDump event name (an XNNPACK operator or a kernel outside delegates)."""
    if name.startswith("native_call_"):
        return OUTSIDE
    if name == RUNTIME_OVERHEAD:
        return name
    lowered = name.lower()
    for kind in KINDS:
        if any(fragment in lowered for fragment in kind.executorch):
            return kind.name
    return "other"


def ort_kind(op_type: str) -> str:
    if op_type == RUNTIME_OVERHEAD:
        return op_type
    for kind in KINDS:
        if op_type in kind.ort:
            return kind.name
    return "other"


def rewrite_can_move(kind: str) -> bool:
    """Whether a graph rewrite can remove time of this kind (else it is the kernels')."""
    return _BY_REWRITE.get(kind, False)


_INSTANCE = re.compile(r" #\d+$")


def etdump_op_profile(
    buffer: bytes, inputs: Sequence, runs: int = 20, warmup: int = 3
) -> OpProfile:
    """Milliseconds per run of each XNNPACK operator (instances summed) and each kernel
    outside delegates, each event counted with its `typical` time over `runs` calls
    after `warmup`, on a fresh load; `calls` counts the events of one run."""
    from executorch.devtools import Inspector
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(buffer, enable_etdump=True, debug_buffer_size=0)
    method = program.load_method("forward")
    for _ in range(warmup + runs):
        method.execute(tuple(inputs))
    with tempfile.TemporaryDirectory() as folder:
        etdump = Path(folder) / "run.etdp"
        program.write_etdump_result_to_file(str(etdump), str(Path(folder) / "debug.bin"))
        inspector = Inspector(etdump_path=str(etdump))
    by_op: Counter[str] = Counter()
    total, calls = 0.0, 0
    for block in inspector.event_blocks:
        for event in block.events if block.name == "Execute" else ():
            if event.perf_data is None:
                continue
            kept = event.perf_data.raw[warmup : warmup + runs]
            if event.name == "Method::execute":
                total += statistics.median(kept)
            elif event.name not in _CALLS:
                by_op[_INSTANCE.sub("", event.name)] += typical(kept)
                calls += 1
    return OpProfile(dict(by_op), total, runs, calls)


_CALLS = ("DELEGATE_CALL", "OPERATOR_CALL")  # around the ops: their time is the ops' plus overhead


@dataclass(frozen=True)
class KindGap:
    kind: str
    executorch_ms: float
    ort_ms: float
    by_rewrite: bool
    top_executorch: tuple[tuple[str, float], ...]  # its largest ops, ms per run
    top_ort: tuple[tuple[str, float], ...]

    @property
    def gap_ms(self) -> float:
        return self.executorch_ms - self.ort_ms


def _top(by_op: dict[str, float], kind_of, kind: str, count: int = 3):
    ops = sorted(((op, ms) for op, ms in by_op.items() if kind_of(op) == kind), key=lambda x: -x[1])
    return tuple(ops[:count])


def with_runtime_overhead(profile: OpProfile, timed_ms: float) -> OpProfile:
    """The profile with `runtime overhead`: an unprofiled timing's median minus the profiled
    ops (never below zero)."""
    overhead = max(0.0, timed_ms - sum(profile.by_op.values()))
    by_op = {**profile.by_op, RUNTIME_OVERHEAD: overhead}
    return OpProfile(by_op, timed_ms, profile.runs, profile.calls)


def gaps_by_kind(executorch: OpProfile, ort: OpProfile) -> list[KindGap]:
    """Each kind of work's milliseconds per run on both runtimes, largest ExecuTorch excess first."""
    ours, theirs = Counter(), Counter()
    for op, ms in executorch.by_op.items():
        ours[executorch_kind(op)] += ms
    for op, ms in ort.by_op.items():
        theirs[ort_kind(op)] += ms
    gaps = [
        KindGap(
            kind,
            ours[kind],
            theirs[kind],
            rewrite_can_move(kind),
            _top(executorch.by_op, executorch_kind, kind),
            _top(ort.by_op, ort_kind, kind),
        )
        for kind in dict.fromkeys([*ours, *theirs])
    ]
    return sorted(gaps, key=lambda g: -g.gap_ms)


def gap_lines(executorch: OpProfile, ort: OpProfile, shown_ms: float = 0.005) -> list[str]:
    """The comparison as text: one line per kind (ms per run on each side, its largest ops,
    and whether a graph rewrite or the kernels decide it), largest ExecuTorch excess first."""
    lines = []
    for gap in gaps_by_kind(executorch, ort):
        if max(gap.executorch_ms, gap.ort_ms) < shown_ms:
            continue
        where = "graph rewrite" if gap.by_rewrite else _kernels_or_runtime(gap.kind)
        ours = ", ".join(f"{_short(op)} {ms:.3f}" for op, ms in gap.top_executorch) or "-"
        theirs = ", ".join(f"{op} {ms:.3f}" for op, ms in gap.top_ort) or "-"
        lines.append(
            f"{gap.kind:26} ET {gap.executorch_ms:7.3f}  ORT {gap.ort_ms:7.3f}  "
            f"gap {gap.gap_ms:+7.3f} ms ({where}); ET: {ours}; ORT: {theirs}"
        )
    return lines


def _kernels_or_runtime(kind: str) -> str:
    return "runtime" if kind == RUNTIME_OVERHEAD else "kernels"


def _short(op: str) -> str:
    return op.removeprefix("native_call_")
