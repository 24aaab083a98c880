# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""`etfold report`: lower each model with stock ExecuTorch and with etfold, run both, compare.

Each model is built afresh for each lowering (its build is seeded), so neither
lowering can see what the other did to a module.

What a row shows, per backend:
- XNNPACK: latency on the runtime in the executorch wheel. Stock and etfold are
  timed interleaved in this process after warm-up, for a time budget
  (`etfold.harness.timing`): median and p10–p90 per call, and the per-round
  ratio etfold/stock with its p10–p90. Each program is loaded three times and
  the loads take turns, so where a load's buffers landed is part of the spread.
- A peer (`peers=("ort",)`, XNNPACK rows only): the same exported program run by
  ONNX Runtime (`etfold.harness.onnx_peer`) with as many threads as the ExecuTorch
  runtime's threadpool, timed interleaved with stock and etfold; its row shows its
  latency, its ratio to stock and to etfold, and its error against eager. A peer's
  failure is its own row's, never a lowering's.
- Arm (TOSA INT): the TOSA operators the delegates hold and, when Vela and the
  harness's Ethos-U helper are installed, Vela's cycle estimate for an Ethos-U55
  and an Ethos-U85. The TOSA reference model only checks numbers here; its
  wall time says nothing about a device and is not shown.

The stock row counts folds upstream applied itself: upstream's Arm scalar-mul
fold is observed by comparing conv→mul sites before and after upstream's own
annotation pipeline. Where a fold etfold declined leaves the two lowerings
different, a note says which decline explains it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from etfold.decisions import FoldDecision, collect_decisions

if TYPE_CHECKING:
    from etfold.demo_models import DemoModel

FLAVOURS = ("stock", "etfold")
PEER_TITLES = {"ort": "ORT"}  # peer flavour -> how its failures are named
MAX_NOTES_PER_FOLD = 3  # distinct decisions per model, fold and verdict shown in the table
UPSTREAM_SCALAR_MUL = "arm.scalar_mul_into_conv"


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
    p10_ms: float = float("nan")
    p90_ms: float = float("nan")
    timed_rounds: int = 0
    ratio: float = float("nan")  # this row/stock per call (etfold, peer rows), median over rounds
    ratio_p10: float = float("nan")
    ratio_p90: float = float("nan")
    vs_etfold: float = float("nan")  # this row/etfold per call (peer rows)
    vs_etfold_p10: float = float("nan")
    vs_etfold_p90: float = float("nan")
    tosa_ops: dict[str, int] = field(default_factory=dict)
    npu_cycles: dict[str, dict[str, int]] = field(default_factory=dict)  # target -> Vela
    notes: list[str] = field(default_factory=list)
    fp32_twin: dict[str, int] = field(default_factory=dict)  # {delegates, ops_outside}


@dataclass(frozen=True)
class TimingPlan:
    budget_s: float = 1.0  # per model, both lowerings together
    min_rounds: int = 10


INSTANCES = 3  # runtime loads of each XNNPACK program, rotated by timing round


@dataclass
class _Lowered:
    """One flavour's lowering, with what the report reads from it."""

    runs: list[Callable[[], object]]  # one per loaded instance of the program
    outputs: Callable[[], list]


def failure_text(error: BaseException) -> str:
    """`Type: first line` of the original error (a wrapper's cause), naming the op node
    being processed when the traceback shows one."""
    while error.__cause__ is not None:  # the original failure, not a wrapper's summary
        error = error.__cause__
    lines = [line for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0].strip() if lines else '(no message)'}"
    node = _innermost_node(error)
    if node is not None:
        from etfold.harness.inspection import op_name

        target = op_name(node.target) if node.op == "call_function" else node.op
        text += f" [at node {node.name}: {target}]"
    return text[:400]


def _innermost_node(error: BaseException):
    """The op node the innermost frame holding a torch.fx.Node was handling, if it is one.

    Only the innermost such frame counts: an outer frame's node is whatever its
    loop last visited, and naming the wrong op is worse than naming none.
    """
    import torch

    found = None
    tb = error.__traceback__
    while tb is not None:
        nodes = [v for v in tb.tb_frame.f_locals.values() if isinstance(v, torch.fx.Node)]
        found = nodes[-1] if nodes else found
        tb = tb.tb_next
    return found if found is not None and found.op == "call_function" else None


def _summarize(decisions: Sequence[FoldDecision], outcome: Outcome) -> None:
    for d in decisions:
        record = {"fold": d.fold, "where": d.where, "detail": d.detail}
        (outcome.applied if d.applied else outcome.declined).append(record)


def xnnpack_lowering(flavour: str, program, partitioner_kwargs: Mapping[str, Any]):
    from etfold.harness import xnnpack_runner

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
        program,
        [XnnpackPartitioner(**partitioner_kwargs)],
        lower=to_edge_transform_and_lower,
        keep_declared_bounds=True,
    )


def _measure_fp32_twin(outcome: Outcome, model: DemoModel) -> None:
    """The same flavour's lowering of the model's fp32 twin: delegates and ops outside."""
    import torch

    from etfold.harness.modules import in_eval_mode

    module, inputs = model.fp32_twin()
    program = torch.export.export(in_eval_mode(module), inputs)
    with collect_decisions():
        lowered = xnnpack_lowering(outcome.flavour, program, model.partitioner_kwargs)
    outcome.fp32_twin = {
        "delegates": lowered.delegates(),
        "ops_outside": sum(lowered.ops_outside().values()),
    }


def _lower_xnnpack(outcome: Outcome, model: DemoModel) -> _Lowered:
    import torch

    from etfold.harness import xnnpack_runner
    from etfold.harness.modules import in_eval_mode

    module, inputs = model.build()
    program = torch.export.export(in_eval_mode(module), inputs)
    with collect_decisions() as decisions:
        lowered = xnnpack_lowering(outcome.flavour, program, model.partitioner_kwargs)
    _summarize(decisions, outcome)
    outcome.delegates = lowered.delegates()
    outcome.ops_outside = dict(lowered.ops_outside())
    outcome.pte_bytes = lowered.pte_bytes
    loads = [xnnpack_runner.load_program(lowered.executorch) for _ in range(INSTANCES - 1)]
    if model.fp32_twin is not None:
        _measure_fp32_twin(outcome, model)
    runs = [lambda: lowered.run(*inputs)]
    runs += [lambda load=load: load.run_method("forward", tuple(inputs)) for load in loads]
    return _Lowered(runs, lambda: lowered.run(*inputs))


def _runtime_threads() -> int:
    from executorch.extension.pybindings import portable_lib

    return portable_lib._threadpool_get_thread_count()


def _lower_peer(model: DemoModel) -> _Lowered:
    """The program the lowerings get, exported to ONNX and loaded `INSTANCES` times in ORT."""
    import torch

    from etfold.harness import onnx_peer
    from etfold.harness.modules import in_eval_mode

    module, inputs = model.build()
    program = torch.export.export(in_eval_mode(module), inputs)
    peer = onnx_peer.export_to_ort(program, threads=_runtime_threads())
    sessions = [peer] + [
        onnx_peer.OrtProgram(
            peer.model, onnx_peer.ort_session(peer.model, peer.threads), peer.threads
        )
        for _ in range(INSTANCES - 1)
    ]
    return _Lowered([s.runner(inputs) for s in sessions], lambda: peer.run(*inputs))


def peer_failure_text(peer: str, error: BaseException) -> str:
    """A peer's failure, named as the peer's: `ORT export: …`, `ORT run: …`."""
    from etfold.harness.onnx_peer import PeerExportFailed, PeerRunFailed

    title = PEER_TITLES.get(peer, peer)
    if isinstance(error, PeerExportFailed):
        return f"{title} export: {error}"
    if isinstance(error, PeerRunFailed):
        return f"{title} run: {error}"
    return f"{title}: {failure_text(error)}"


def _arm_folds(flavour: str):
    import contextlib

    if flavour == "stock":
        return contextlib.nullcontext()
    from etfold.backends.arm import arm_folds_registered

    return arm_folds_registered()


def upstream_scalar_mul_folds(module, inputs) -> list[FoldDecision]:
    """The conv × scale sites upstream's own annotation pipeline folds in this model.

    Read by comparison: conv→mul sites in the exported graph, then in the graph
    upstream's `transform_for_annotation` (which runs its unguarded
    FoldScalarMulIntoConvPass) returns; every site gone was folded by upstream.
    """
    import copy

    import torch

    from etfold.harness.modules import in_eval_mode
    from etfold.harness.tosa_runner import tosa_quantizer

    exported = torch.export.export(in_eval_mode(copy.deepcopy(module)), inputs)
    graph_module = exported.module(check_guards=False)
    before = _conv_mul_sites(graph_module)
    after = _conv_mul_sites(tosa_quantizer().transform_for_annotation(graph_module))
    folded = len(before) - len(after)
    return [
        FoldDecision(
            UPSTREAM_SCALAR_MUL,
            True,
            name,
            "by upstream's FoldScalarMulIntoConvPass (no carried-state or sharing guard)",
        )
        for name in before[:folded]
    ]


def _conv_mul_sites(graph_module) -> list[str]:
    """The multiplies one of whose operands is a conv (the Arm toolkit says which ops are)."""
    import torch

    from etfold.backends.arm._passes.conv_arguments import ConvArguments, conv_arguments
    from etfold.exir.passes.graph_walk import underlying_op

    def is_conv(value) -> bool:
        found = conv_arguments(value)
        return isinstance(found, ConvArguments) and not found.linear

    mul = {torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar}
    return [
        node.name
        for node in graph_module.graph.nodes
        if node.op == "call_function"
        and underlying_op(node.target) in mul
        and any(is_conv(a) for a in node.args)
    ]


def _lower_arm(outcome: Outcome, model: DemoModel) -> _Lowered:
    from etfold.harness import tosa_runner

    module, inputs = model.build()
    if outcome.flavour == "stock":
        _summarize(upstream_scalar_mul_folds(module, inputs), outcome)
    with collect_decisions() as decisions, _arm_folds(outcome.flavour):
        program = tosa_runner.quantize_for_tosa(module, inputs, calibration=model.calibration())
        lowered = tosa_runner.lower_tosa(program)
    _summarize(decisions, outcome)
    outcome.delegates = lowered.delegates()
    outcome.ops_outside = dict(lowered.ops_outside())
    outcome.tosa_ops = dict(sorted(lowered.operator_counts().items()))
    outcome.pte_bytes = len(lowered.edge.to_executorch().buffer)
    return _Lowered([lambda: lowered.run(*inputs)], lambda: lowered.run(*inputs).outputs)


def vela_available() -> bool:
    return (
        importlib.util.find_spec("etfold.harness.vela") is not None
        and importlib.util.find_spec("ethosu") is not None
    )


def _add_npu_cycles(outcome: Outcome, model: DemoModel, between: Callable[[], None]) -> None:
    """Vela's estimate for each Ethos-U target; a Vela failure is a note, not a failed row."""
    from etfold.harness import vela

    for target in vela.TARGETS:
        between()
        module, inputs = model.build()
        try:
            with collect_decisions(), _arm_folds(outcome.flavour):
                program = vela.lower_module_ethos_u(
                    module, inputs, target, calibration=model.calibration()
                )
            estimate = program.estimate
        except Exception as error:  # the row stands without the estimate
            outcome.notes.append(f"Vela {target}: {failure_text(error)}")
            continue
        outcome.npu_cycles[target] = {
            "total": estimate.total_cycles,
            "npu": estimate.npu_cycles,
        }


def _time(lowered: Mapping[str, _Lowered], outcomes: Mapping[str, Outcome], plan: TimingPlan):
    from etfold.harness.timing import time_interleaved

    timing = time_interleaved(
        {flavour: low.runs for flavour, low in lowered.items()},
        budget_s=plan.budget_s,
        min_rounds=plan.min_rounds,
    )
    for flavour, spread in timing.milliseconds.items():
        o = outcomes[flavour]
        o.median_ms, o.p10_ms, o.p90_ms = spread.median, spread.p10, spread.p90
        o.timed_rounds = timing.rounds
    for (base, flavour), ratio in timing.ratios.items():  # (a, b): b/a, names in row order
        o = outcomes[flavour]
        if base == "stock":
            o.ratio, o.ratio_p10, o.ratio_p90 = ratio.median, ratio.p10, ratio.p90
        elif base == "etfold":
            o.vs_etfold, o.vs_etfold_p10, o.vs_etfold_p90 = ratio.median, ratio.p10, ratio.p90


def _explain_differences(stock: Outcome, ours: Outcome) -> None:
    """A note on the etfold row when a fold stock applied was declined by etfold."""
    if stock.failure or ours.failure:
        return
    stock_applied = Counter(r["fold"] for r in stock.applied)
    for fold, count in stock_applied.items():
        ours_applied = sum(r["fold"] == fold for r in ours.applied)
        declines = [r for r in ours.declined if r["fold"] == fold]
        if ours_applied >= count or not declines:
            continue
        size = ours.pte_bytes - stock.pte_bytes
        ours.notes.append(
            f"stock applied {fold} {count}× where etfold declined {count - ours_applied}× "
            f"({declines[0]['detail']}); that is the .pte difference ({size:+,} B) "
            "and the ops it keeps"
        )


def evaluate(
    model: DemoModel,
    *,
    timing: TimingPlan | None = None,
    npu: bool = True,
    debug: bool = False,
    alone: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    between: Callable[[], None] = lambda: None,
    peers: Sequence[str] = (),
) -> list[Outcome]:
    """Stock and etfold outcomes for one model, then one per peer (XNNPACK models only);
    a failing lowering is reported, not raised.

    The latency timing runs inside `alone()`, and `between()` is called between
    lowerings: a parallel run makes timing wait until nothing else runs, and a
    lowering wait while another worker times (`etfold.report_workers.TimingGate`).
    """
    from etfold.harness import xnnpack_runner

    plan = timing or TimingPlan()
    module, inputs = model.build()
    reference = xnnpack_runner.eager_outputs(module, inputs)
    outcomes = {f: Outcome(model.name, model.backend, f) for f in FLAVOURS}
    lowered: dict[str, _Lowered] = {}
    lower = {"xnnpack": _lower_xnnpack, "arm": _lower_arm}.get(model.backend)
    for flavour, outcome in outcomes.items():
        between()
        try:
            if lower is None:
                raise ValueError(f"unknown backend {model.backend!r}")
            low = lower(outcome, model)
            outcome.max_error = xnnpack_runner.max_abs_error(low.outputs(), reference)
            lowered[flavour] = low
        except Exception as error:  # the report shows a failed lowering instead of dying
            outcome.failure = failure_text(error)
            if debug:
                traceback.print_exc(file=sys.stderr)
    if model.backend == "xnnpack":
        _add_peers(model, outcomes, lowered, reference, peers, debug, between)
    if model.backend == "xnnpack" and lowered:
        with alone():
            _time(lowered, outcomes, plan)
    if model.backend == "arm" and npu and vela_available():
        for flavour in lowered:
            _add_npu_cycles(outcomes[flavour], model, between)
    _explain_differences(outcomes["stock"], outcomes["etfold"])
    return list(outcomes.values())


def _add_peers(model, outcomes, lowered, reference, peers, debug, between) -> None:
    from etfold.harness import xnnpack_runner

    for peer in peers:
        between()
        outcome = outcomes[peer] = Outcome(model.name, model.backend, peer)
        try:
            low = _lower_peer(model)
            outcome.max_error = xnnpack_runner.max_abs_error(low.outputs(), reference)
            lowered[peer] = low
        except Exception as error:  # the peer's failure is its row's
            outcome.failure = peer_failure_text(peer, error)
            if debug:
                traceback.print_exc(file=sys.stderr)


class UserInputError(ValueError):
    """A user's file or argument the report cannot use; the message is one line."""


def load_user_program(path: str):
    """torch.export.load(path), with every way a file can be unusable as one clear line."""
    import os
    import zipfile

    import torch

    if not os.path.exists(path):
        raise UserInputError(f"{path}: no such file")
    if os.path.isdir(path):
        raise UserInputError(f"{path}: is a directory, expected a .pt2 file")
    if not zipfile.is_zipfile(path):
        raise UserInputError(
            f"{path}: not a readable .pt2 archive (truncated, or not written by "
            "torch.export.save(program, path))"
        )
    try:
        with _logged_errors("torch.export") as logged:
            program = torch.export.load(path)
    except Exception as error:
        raise UserInputError(_load_error_text(path, error, logged)) from error
    if program.example_inputs is None:
        raise UserInputError(
            f"{path}: saved without example inputs; export with example args "
            "(torch.export.export(model, args)) and save again"
        )
    args, kwargs = program.example_inputs
    if kwargs:
        raise UserInputError(
            f"{path}: example inputs are passed by keyword ({', '.join(sorted(kwargs))}); "
            "the report needs positional example inputs"
        )
    return program


@contextlib.contextmanager
def _logged_errors(logger_name: str) -> Iterator[list[str]]:
    """Messages (and logged exceptions) of a logger during the block: torch.export.load
    logs the real reason a program does not deserialize and raises a generic error."""
    import logging

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())
            if record.exc_info and record.exc_info[1] is not None:
                error = record.exc_info[1]
                while error is not None:
                    messages.append(str(error))
                    error = error.__cause__ or error.__context__

    logger = logging.getLogger(logger_name)
    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def _load_error_text(path: str, error: BaseException, logged: Sequence[str]) -> str:
    import re

    for text in (*logged, str(error)):
        unresolved = re.search(r"failed to resolve (\S+) to an operator", text)
        if unresolved:
            return (
                f"{path}: uses {unresolved.group(1)}, which is not registered in this process "
                "(import the library that defines the custom op, then run the report from Python)"
            )
    message = " ".join(str(error).split())
    return f"{path}: cannot read the exported program ({type(error).__name__}: {message[:200]})"


def user_program(path: str, backend: str, calibration=None) -> DemoModel:
    """A user's `.pt2` as a report model; each build loads it afresh. An Arm model
    calibrates on its example inputs, then on the samples of `calibration`
    (an `etfold.calibration.CalibrationSource`, which imports this module).
    """
    from etfold.demo_models.base import DemoModel

    def build():
        program = load_user_program(path)
        args, _ = program.example_inputs
        return program.module(check_guards=False), tuple(args)

    def samples():
        return calibration.samples(load_user_program(path)) if calibration else []

    return DemoModel(path, backend, build, "a user's exported program", calibration=samples)


def _ops_text(ops: Mapping[str, int], top: int = 2) -> str:
    total = sum(ops.values())
    if not total:
        return "0"
    kinds = ", ".join(
        f"{name.split('.')[-2] if name.count('.') >= 2 else name}×{n}"
        for name, n in Counter(ops).most_common(top)
    )
    more = ", …" if len(ops) > top else ""
    return f"{total} ({kinds}{more})"


def decision_notes(
    prefix: str, records: Sequence[dict[str, str]], explain: bool = False
) -> list[str]:
    """One line per distinct (fold, detail) with its count, at most a few per fold.

    With `explain`, one line per decision, each with where it was taken.
    """
    if explain:
        return [f"{prefix} {r['fold']}: {r['detail'] or '-'} ({r['where']})" for r in records]
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
                f"{prefix} {fold}: {kind_count - MAX_NOTES_PER_FOLD} more (--explain lists all)"
            )
    return lines


def _ratio_cell(median: float, p10: float, p90: float) -> str:
    if median != median:  # NaN: no paired timing
        return "-"
    return f"{median:.2f}x ({p10:.2f}–{p90:.2f})"


def _latency_cells(o: Outcome, peers: bool) -> tuple[str, ...]:
    if o.timed_rounds == 0:
        return ("-",) * (3 if peers else 2)
    latency = f"{o.median_ms:.3f} ({o.p10_ms:.3f}–{o.p90_ms:.3f})"
    cells = (latency, _ratio_cell(o.ratio, o.ratio_p10, o.ratio_p90))
    if peers:
        cells += (_ratio_cell(o.vs_etfold, o.vs_etfold_p10, o.vs_etfold_p90),)
    return cells


def is_peer(o: Outcome) -> bool:
    return o.flavour not in FLAVOURS


def _cycles_cell(o: Outcome, target: str) -> str:
    cycles = o.npu_cycles.get(target)
    return f"{cycles['total']:,}" if cycles else "-"


def _folds_cell(o: Outcome) -> str:
    return f"{len(o.applied)} applied, {len(o.declined)} declined"


_COMMON = ("model", "lowering", "delegates", "ops outside", ".pte bytes")


def _twin_cell(o: Outcome) -> str:
    if not o.fp32_twin or is_peer(o):
        return "-"
    return f"{o.fp32_twin['delegates']} / {o.fp32_twin['ops_outside']}"


def _table_header(backend: str, targets: Sequence[str], peers: bool = False) -> tuple[str, ...]:
    if backend == "xnnpack" and peers:  # a row's time over stock's, over etfold's
        ratios = ("row/stock (p10–p90)", "row/etfold (p10–p90)")
        extra = ("median ms (p10–p90)", *ratios, "fp32 twin deleg/outside")
    elif backend == "xnnpack":
        extra = ("median ms (p10–p90)", "etfold/stock (p10–p90)", "fp32 twin deleg/outside")
    else:
        extra = ("TOSA ops", *(f"{t} cycles" for t in targets))
    return (*_COMMON, *extra, "max err", "folds")


def _table_cells(
    o: Outcome, targets: Sequence[str], columns: int, peers: bool = False
) -> tuple[str, ...]:
    if o.failure:
        return (o.model, o.flavour, *["-"] * (columns - 3), f"FAILED: {o.failure}")
    if o.backend == "xnnpack":
        cells = (*_latency_cells(o, peers), _twin_cell(o))
    else:
        cells = (_ops_text(o.tosa_ops, 3), *(_cycles_cell(o, t) for t in targets))
    if is_peer(o):  # no ExecuTorch program: its structure cells are empty
        return (o.model, o.flavour, "-", "-", "-", *cells, f"{o.max_error:.3g}", "-")
    return (
        o.model,
        o.flavour,
        str(o.delegates),
        _ops_text(o.ops_outside),
        f"{o.pte_bytes:,}",
        *cells,
        f"{o.max_error:.3g}",
        _folds_cell(o),
    )


def _aligned(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(cell.ljust(w) for cell, w in zip(cells, widths, strict=True)).rstrip()


def _title(backend: str) -> str:
    return "XNNPACK" if backend == "xnnpack" else "Arm TOSA INT" if backend == "arm" else backend


def _backend_table(outcomes: Sequence[Outcome], backend: str, targets: Sequence[str]) -> list[str]:
    peers = any(is_peer(o) for o in outcomes)
    header = _table_header(backend, targets, peers)
    rows = [_table_cells(o, targets, len(header), peers) for o in outcomes]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [_aligned(header, widths), _aligned(["-" * w for w in widths], widths)] + [
        _aligned(r, widths) for r in rows
    ]


def _decision_lines(outcomes: Sequence[Outcome], explain: bool) -> list[str]:
    notes = []
    for o in outcomes:
        for verdict, records in (("applied ", o.applied), ("declined", o.declined)):
            notes += decision_notes(f"  {o.model} [{o.flavour}] {verdict}", records, explain)
        notes += [f"  {o.model} [{o.flavour}] note     {n}" for n in o.notes]
    return ["", "fold decisions:", *notes] if notes else []


def format_table(outcomes: Sequence[Outcome], *, explain: bool = False) -> str:
    """The whole table, each backend's columns as wide as its widest cell."""
    out: list[str] = []
    for backend in dict.fromkeys(o.backend for o in outcomes):
        rows = [o for o in outcomes if o.backend == backend]
        targets = sorted({t for o in rows for t in o.npu_cycles})
        out += [
            *([""] if out else []),
            f"{_title(backend)}:",
            *_backend_table(rows, backend, targets),
        ]
    return "\n".join(out + _decision_lines(outcomes, explain))


# room for a typical cell where the header is narrower (a wider cell shifts the rest of its row)
_STREAM_WIDTHS = {
    "ops outside": 50,
    "median ms (p10–p90)": 24,
    "row/stock (p10–p90)": 22,
    "row/etfold (p10–p90)": 22,
    "TOSA ops": 42,
    "max err": 8,
}


class TableStream:
    """The table a model at a time, so `etfold report` prints rows as they finish.

    Columns have fixed widths: the header's, the longest model name, and room
    for a typical cell. A section (title, header) starts whenever the backend
    changes or a row brings NPU targets its section lacks; the fold decisions
    follow the last row (`close`).
    """

    def __init__(self, model_width: int, *, explain: bool = False, peers: bool = False):
        self._model_width = model_width
        self._explain = explain
        self._peers = peers  # peer rows follow: the XNNPACK header has a column per ratio
        self._section: tuple[str, tuple[str, ...], list[int]] | None = None
        self._outcomes: list[Outcome] = []

    def add(self, outcomes: Sequence[Outcome]) -> list[str]:
        lines: list[str] = []
        for backend in dict.fromkeys(o.backend for o in outcomes):
            rows = [o for o in outcomes if o.backend == backend]
            lines += self._section_for(backend, {t for o in rows for t in o.npu_cycles})
            _, targets, widths = self._section
            cells = [_table_cells(o, targets, len(widths), self._peers) for o in rows]
            lines += [_aligned(c, widths) for c in cells]
        self._outcomes += outcomes
        return lines

    def _section_for(self, backend: str, targets: set[str]) -> list[str]:
        if self._section and self._section[0] == backend and targets <= set(self._section[1]):
            return []
        header = _table_header(backend, sorted(targets), self._peers)
        widths = [_STREAM_WIDTHS.get(h, len(h)) for h in header]
        widths[0] = max(widths[0], self._model_width)
        widths[-1] = 0  # the last column is never padded
        lines = [""] if self._section else []
        self._section = (backend, tuple(sorted(targets)), widths)
        dashes = ["-" * max(w, len(h)) for w, h in zip(widths, header, strict=True)]
        return [*lines, f"{_title(backend)}:", _aligned(header, widths), _aligned(dashes, widths)]

    def close(self) -> list[str]:
        return _decision_lines(self._outcomes, self._explain)


def as_json_rows(outcomes: Sequence[Outcome]) -> list[dict]:
    return [asdict(o) for o in outcomes]
