# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""ONNX Runtime as a peer: the program stock and etfold lower, run by ONNX Runtime on the CPU.

A user choosing a CPU runtime compares ExecuTorch with ONNX Runtime, so the report
and the benches can put ORT beside stock and etfold: the same `ExportedProgram`
(static or with its `torch.export.Dim` shapes) goes through
`torch.onnx.export(program, dynamo=True, optimize=True)` and runs in an
`InferenceSession` on the CPU execution provider with all graph optimizations
(`ORT_ENABLE_ALL`), `threads` intra-op threads and one inter-op thread.

ONNX Runtime, onnx and onnxscript are optional (`pip install 'etfold[peers]'`):
this module imports only the standard library at import time, and ORT only when
a peer is asked for. Failures are raised as `PeerExportFailed` / `PeerRunFailed`,
so a caller reports them as ORT's, never as a lowering's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

PEERS = ("ort",)
INSTALL_HINT = "pip install 'etfold[peers]'"
# what `torch.onnx.export(..., dynamo=True, optimize=True)` and the session import
REQUIRED_MODULES = ("onnxruntime", "onnx", "onnxscript")


class PeerUnavailable(ImportError):
    """A peer's packages are not importable; the message is one line saying how to get them."""


class PeerExportFailed(RuntimeError):
    """torch.onnx.export failed on a program (ORT's side, not a lowering's)."""


class PeerRunFailed(RuntimeError):
    """ONNX Runtime failed to load or run an exported model."""


def _importable(name: str) -> bool:
    if name in sys.modules:
        return sys.modules[name] is not None  # None: imports of it are blocked
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing_modules() -> tuple[str, ...]:
    """The modules ORT as a peer needs that cannot be imported here (nothing is imported)."""
    return tuple(m for m in REQUIRED_MODULES if not _importable(m))


def unavailable_text() -> str | None:
    """One line saying what is missing and how to install it, or None when ORT can run."""
    missing = missing_modules()
    if not missing:
        return None
    return f"--peer ort needs {', '.join(missing)}: {INSTALL_HINT}"


def require() -> None:
    text = unavailable_text()
    if text is not None:
        raise PeerUnavailable(text)


def session_options(threads: int = 1, profile_prefix: str | None = None):
    """`threads` intra-op threads, one inter-op thread, sequential, every graph optimization."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # errors only: ORT's warnings are not the report's
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return options


def onnx_model_bytes(program) -> bytes:
    """`torch.onnx.export(program, dynamo=True, optimize=True)` of an ExportedProgram, serialized.

    The exporter is handed the ExportedProgram itself, so its shapes (static or
    `Dim` ranges) are the ones the ExecuTorch lowerings get. The caller hands a
    program it owns: the exporter decomposes it.
    """
    require()
    import torch

    try:
        exported = torch.onnx.export(program, (), dynamo=True, optimize=True, verbose=False)
        return exported.model_proto.SerializeToString()
    except Exception as error:
        raise PeerExportFailed(_first_line(error)) from error


def _first_line(error: BaseException) -> str:
    while error.__cause__ is not None:
        error = error.__cause__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else '(no message)'}"[:300]


@dataclass
class OrtProgram:
    """An ONNX model and its ORT session; `run` mirrors `XnnpackProgram.run`."""

    model: bytes
    session: Any
    threads: int

    def feeds(self, inputs: Sequence) -> dict[str, Any]:
        """ORT's input dict for positional torch tensors (names from the model)."""
        names = [i.name for i in self.session.get_inputs()]
        if len(names) != len(inputs):
            raise PeerRunFailed(f"the ONNX model takes {len(names)} inputs, given {len(inputs)}")
        return {n: t.detach().contiguous().numpy() for n, t in zip(names, inputs, strict=True)}

    def run(self, *inputs) -> list:
        import torch

        try:
            outputs = self.session.run(None, self.feeds(inputs))
        except PeerRunFailed:
            raise
        except Exception as error:
            raise PeerRunFailed(_first_line(error)) from error
        return [torch.from_numpy(o) for o in outputs]

    def runner(self, inputs: Sequence) -> Callable[[], object]:
        """One call of the session on `inputs`, converted once: what timing repeats."""
        feeds, run = self.feeds(inputs), self.session.run
        return lambda: run(None, feeds)


def ort_session(model: bytes, threads: int = 1, profile_prefix: str | None = None):
    import onnxruntime

    try:
        return onnxruntime.InferenceSession(
            model, session_options(threads, profile_prefix), providers=["CPUExecutionProvider"]
        )
    except Exception as error:
        raise PeerRunFailed(_first_line(error)) from error


def export_to_ort(program, threads: int = 1) -> OrtProgram:
    """The program exported to ONNX and loaded in an ORT session (see the module docstring)."""
    model = onnx_model_bytes(program)
    return OrtProgram(model, ort_session(model, threads), threads)


@dataclass(frozen=True)
class OpProfile:
    """Milliseconds per run by op (`typical` of each node or event over the profiled runs),
    the whole run's, and how many kernels a run calls."""

    by_op: dict[str, float]
    total_ms: float
    runs: int
    calls: int = 0  # kernels called per run


def typical(values: Sequence[float]) -> float:
    """The mean of the values once the slowest tenth is left out: a profiler's ticks are
    whole microseconds, so a sub-microsecond op reads 0 most runs and 1 some (a median
    says 0); a run preempted by another process is among the slowest and left out."""
    ordered = sorted(values)
    kept = ordered[: max(1, len(ordered) - math.ceil(len(ordered) / 10))]
    return sum(kept) / len(kept)


def ort_op_profile(
    peer: OrtProgram, inputs: Sequence, runs: int = 20, warmup: int = 3
) -> OpProfile:
    """ORT's own profiler (`enable_profiling`) over `runs` calls after `warmup`: each node's
    kernel time by ONNX op type. The profiler's own cost lands between kernels (on a
    small model it is most of a profiled run), so the time outside kernels is read from
    an unprofiled timing instead (`op_profiles.gap_lines`)."""
    with tempfile.TemporaryDirectory() as folder:
        session = ort_session(peer.model, peer.threads, os.path.join(folder, "ort"))
        feeds = OrtProgram(peer.model, session, peer.threads).feeds(inputs)
        for _ in range(warmup + runs):
            session.run(None, feeds)
        with open(session.end_profiling()) as file:
            events = json.load(file)
    return profile_from_events(events, warmup)


def profile_from_events(events: Sequence[dict], skip_runs: int) -> OpProfile:
    """ORT profile events -> milliseconds per run by op type, the first `skip_runs` runs left out.

    A run is a `model_run` event; a kernel is a `Node` event whose name ends in
    `_kernel_time` and starts within a kept run (times are in microseconds). Each
    node counts with its `typical` time over the kept runs.
    """
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    runs = runs[skip_runs:]
    if not runs:
        raise ValueError("the ORT profile holds no runs past the warm-up")
    per_node: dict[tuple[str, str], list[float]] = {}
    for e in events:
        if _is_kernel(e) and e["ts"] >= runs[0][0]:
            key = (e["name"], e.get("args", {}).get("op_name", "?"))
            per_node.setdefault(key, []).append(e["dur"])
    by_op: Counter[str] = Counter()
    for (_, op), durations in per_node.items():
        by_op[op] += typical(durations) * 1e-3
    total = statistics.median(end - begin for begin, end in runs) * 1e-3
    return OpProfile(dict(by_op), total, len(runs), len(per_node))


def _is_kernel(event: dict) -> bool:
    return event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time")
