"""`etfold report`: lower each model with stock ExecuTorch and with etfold, run both, compare.

Each model is built afresh for each lowering (its build is seeded), so neither
lowering can see what the other did to a module.
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from etfold.decisions import FoldDecision, collect_decisions
from etfold.demo_models import DemoModel
from etfold.harness import tosa_runner, xnnpack_runner
from etfold.harness.modules import in_eval_mode

FLAVOURS = ("stock", "etfold")
MAX_NOTES_PER_FOLD = 3  # distinct decisions per model, fold and verdict shown in the table


@dataclass
class Outcome:
    model: str
    backend: str
    flavour: str
    delegates: int = 0
    ops_outside: dict[str, int] = field(default_factory=dict)
    pte_bytes: int = 0
    median_ms: float = float("nan")
    max_error: float = float("nan")
    applied: list[dict[str, str]] = field(default_factory=list)  # {fold, where, detail}
    declined: list[dict[str, str]] = field(default_factory=list)
    failure: str | None = None


def _median_ms(run: Callable[[], object], runs: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _summarize(decisions: Sequence[FoldDecision], outcome: Outcome) -> None:
    for d in decisions:
        record = {"fold": d.fold, "where": d.where, "detail": d.detail}
        (outcome.applied if d.applied else outcome.declined).append(record)


def _xnnpack_lowering(flavour: str, program, partitioner_kwargs: Mapping[str, Any]):
    if flavour == "stock":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
            XnnpackPartitioner as UpstreamXnnpackPartitioner,
        )

        return xnnpack_runner.lower_xnnpack(
            program, [UpstreamXnnpackPartitioner(**partitioner_kwargs)]
        )
    from etfold.backends.xnnpack import XnnpackPartitioner
    from etfold.exir import to_edge_transform_and_lower

    return xnnpack_runner.lower_xnnpack(
        program, [XnnpackPartitioner(**partitioner_kwargs)], lower=to_edge_transform_and_lower
    )


def _run_xnnpack(
    outcome: Outcome, module, inputs, reference, runs: int, partitioner_kwargs: Mapping[str, Any]
) -> None:
    program = torch.export.export(in_eval_mode(module), inputs)
    with collect_decisions() as decisions:
        lowered = _xnnpack_lowering(outcome.flavour, program, partitioner_kwargs)
    _summarize(decisions, outcome)
    outcome.delegates = lowered.delegates()
    outcome.ops_outside = dict(lowered.ops_outside())
    outcome.pte_bytes = lowered.pte_bytes
    outcome.max_error = xnnpack_runner.max_abs_error(lowered.run(*inputs), reference)
    outcome.median_ms = _median_ms(lambda: lowered.run(*inputs), runs)


def _run_arm(outcome: Outcome, module, inputs, reference, runs: int, calibration) -> None:
    from etfold.backends.arm import arm_folds_registered

    def lower():
        program = tosa_runner.quantize_for_tosa(module, inputs, calibration=calibration)
        return tosa_runner.lower_tosa(program)

    with collect_decisions() as decisions:
        if outcome.flavour == "stock":
            lowered = lower()
        else:
            with arm_folds_registered():
                lowered = lower()
    _summarize(decisions, outcome)
    outcome.delegates = lowered.delegates()
    outcome.ops_outside = dict(lowered.ops_outside())
    outcome.pte_bytes = len(lowered.edge.to_executorch().buffer)
    outcome.max_error = xnnpack_runner.max_abs_error(lowered.run(*inputs).outputs, reference)
    outcome.median_ms = _median_ms(lambda: lowered.run(*inputs), runs)


def evaluate(model: DemoModel, *, runs: int = 5) -> list[Outcome]:
    """Stock and etfold outcomes for one model; a failing lowering is reported, not raised."""
    module, inputs = model.build()
    reference = xnnpack_runner.eager_outputs(module, inputs)
    outcomes = []
    for flavour in FLAVOURS:
        outcome = Outcome(model.name, model.backend, flavour)
        module, inputs = model.build()
        try:
            if model.backend == "xnnpack":
                _run_xnnpack(outcome, module, inputs, reference, runs, model.partitioner_kwargs)
            elif model.backend == "arm":
                _run_arm(outcome, module, inputs, reference, runs, model.calibration())
            else:
                raise ValueError(f"unknown backend {model.backend!r}")
        except Exception as error:  # the report shows a failed lowering instead of dying
            outcome.failure = f"{type(error).__name__}: {error}".splitlines()[0][:300]
            traceback.print_exc(file=sys.stderr)
        outcomes.append(outcome)
    return outcomes


def user_program(path: str, backend: str) -> DemoModel:
    """A user's `.pt2` as a report model; each build loads it afresh."""

    def build():
        program = torch.export.load(path)
        if program.example_inputs is None:
            raise ValueError(
                f"{path} has no example inputs; export with example args and save again"
            )
        args, kwargs = program.example_inputs
        if kwargs:
            raise ValueError(f"{path}: keyword example inputs are not supported by the report")
        return program.module(check_guards=False), tuple(args)

    return DemoModel(path, backend, build, "a user's exported program")


def _ops_text(ops: dict[str, int]) -> str:
    total = sum(ops.values())
    if not total:
        return "0"
    top = ", ".join(
        f"{name.split('.')[-2] if '.' in name else name}×{n}"
        for name, n in Counter(ops).most_common(2)
    )
    return f"{total} ({top})"


def _decision_notes(prefix: str, records: Sequence[dict[str, str]]) -> list[str]:
    """One line per distinct (fold, detail) with its count, at most a few per fold."""
    groups = Counter((r["fold"], r["detail"]) for r in records)
    example = {(r["fold"], r["detail"]): r["where"] for r in reversed(records)}
    lines, kinds = [], Counter()
    for (fold, detail), count in groups.items():
        kinds[fold] += 1
        if kinds[fold] > MAX_NOTES_PER_FOLD:
            continue
        times = f" ×{count}" if count > 1 else ""
        where = f"e.g. {example[fold, detail]}" if count > 1 else example[fold, detail]
        lines.append(f"{prefix} {fold}{times}: {detail or '-'} ({where})")
    for fold, kind_count in kinds.items():
        if kind_count > MAX_NOTES_PER_FOLD:
            lines.append(
                f"{prefix} {fold}: {kind_count - MAX_NOTES_PER_FOLD} more (--json lists all)"
            )
    return lines


def format_table(outcomes: Sequence[Outcome]) -> str:
    header = (
        "model",
        "backend",
        "lowering",
        "delegates",
        "ops outside",
        ".pte bytes",
        "median ms",
        "max err",
        "folds",
    )
    rows = []
    for o in outcomes:
        if o.failure:
            rows.append(
                (o.model, o.backend, o.flavour, "-", "-", "-", "-", "-", f"FAILED: {o.failure}")
            )
            continue
        rows.append(
            (
                o.model,
                o.backend,
                o.flavour,
                str(o.delegates),
                _ops_text(o.ops_outside),
                f"{o.pte_bytes:,}",
                f"{o.median_ms:.3f}",
                f"{o.max_error:.3g}",
                f"{len(o.applied)} applied, {len(o.declined)} declined",
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
    out = [line(header), line(tuple("-" * w for w in widths)), *map(line, rows)]
    notes = []
    for o in outcomes:
        for verdict, records in (("applied ", o.applied), ("declined", o.declined)):
            notes += _decision_notes(f"  {o.model} [{o.flavour}] {verdict}", records)
    if notes:
        out += ["", "fold decisions:", *notes]
    return "\n".join(out)


def as_json_rows(outcomes: Sequence[Outcome]) -> list[dict]:
    return [asdict(o) for o in outcomes]
