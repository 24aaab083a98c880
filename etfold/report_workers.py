# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Run `etfold report` models one per task, on both cores, with latency timed alone.

A task is one model: its stock and etfold lowerings, runs and timing stay in
one process, so the two are still timed interleaved after the same warm-up,
exactly as in a serial run. Up to `jobs` spawned worker processes take tasks;
exporting, lowering, the reference model and Vela of two models overlap.

The latency phase must not share the CPU with another model's lowering, so the
workers share a `TimingGate`: a worker holds one of `jobs` permits while it
works, and to time it gives its permit back and takes all `jobs` of them
through a turnstile. A timed phase therefore starts only once every other
worker has reached the end of its current step (one lowering, one Vela
estimate), of its model, or its own timed phase, where it waits; no worker
starts a new step until the timed phase ends. The parent only schedules tasks
and prints what comes back.

Timing alone, rather than lowering everything first and timing at the end,
keeps rows streaming: a model's row is out as soon as its own timing is done.

Imports stay lazy: the parent of a parallel run never imports torch.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from etfold.calibration import CalibrationSource
    from etfold.demo_models import CatalogueEntry, DemoModel
    from etfold.report import Outcome, TimingPlan

MAX_JOBS = 2  # the machines etfold is measured on have two cores


@dataclass(frozen=True)
class ModelRef:
    """What a worker needs to build a model: a catalogue entry or a user's `.pt2`."""

    name: str
    backend: str
    entry: CatalogueEntry | None = None
    program: str | None = None
    calibration: CalibrationSource | None = None  # a user's program on Arm

    @classmethod
    def of_entry(cls, entry: CatalogueEntry) -> ModelRef:
        return cls(entry.name, entry.backend, entry=entry)

    def load(self) -> DemoModel:
        if self.entry is None:
            from etfold.report import user_program

            return user_program(self.program, self.backend, self.calibration)
        from etfold import demo_models

        (model,) = demo_models.load([self.entry])
        return model


@dataclass(frozen=True)
class RunOptions:
    timing: TimingPlan
    npu: bool = True
    debug: bool = False
    capture: bool = True  # third-party chatter to a scratch file (else to stderr)
    verbose: bool = False
    peers: tuple[str, ...] = ()  # other runtimes timed beside stock and etfold ("ort")


class TimingGate:
    """Lets a timed phase run while the other workers sharing the gate wait.

    Every worker holds one permit inside `working()`; `alone()`, entered from
    inside `working()`, trades it for all of them. The turnstile keeps new work
    from starting while a timed phase waits for its permits; `between()` hands
    the permit over at a step boundary, so a timed phase waits for one step of
    another model (one lowering), not for the whole model.
    """

    def __init__(self, context, workers: int):
        self._workers = workers
        self._permits = context.Semaphore(workers)
        self._turnstile = context.Lock()

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        with self._turnstile:
            self._permits.acquire()
        try:
            yield
        finally:
            self._permits.release()

    def between(self) -> None:
        """Between two steps of work: a timed phase waiting for permits runs now."""
        self._permits.release()
        with self._turnstile:
            self._permits.acquire()

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        self._permits.release()
        try:
            with self._turnstile:
                for _ in range(self._workers):
                    self._permits.acquire()
                try:
                    yield
                finally:
                    for _ in range(self._workers):
                        self._permits.release()
        finally:
            with self._turnstile:
                self._permits.acquire()


@contextlib.contextmanager
def chatter_kept_off_stdout(capture: bool) -> Iterator[None]:
    """Keep stdout for the report while a model runs: with `capture`, Python warnings,
    logging and C-level runtime output go to a scratch file; without, to stderr."""
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile() if capture else contextlib.nullcontext() as scratch:
        target = scratch.fileno() if capture else 2
        fds = (1, 2) if capture else (1,)
        saved = {fd: os.dup(fd) for fd in fds}
        text = open(target, "w", closefd=False, encoding="utf-8", errors="replace")  # noqa: SIM115
        quiet = contextlib.redirect_stderr(text) if capture else contextlib.nullcontext()
        try:
            for fd in fds:
                os.dup2(target, fd)
            with contextlib.redirect_stdout(text), quiet, warnings.catch_warnings():
                if capture:
                    warnings.simplefilter("ignore")
                yield
        finally:
            text.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)


def evaluate(
    ref: ModelRef, options: RunOptions, gate: TimingGate | None = None
) -> tuple[list[Outcome], float]:
    """One model's stock and etfold outcomes, and the seconds they took."""
    from etfold import report

    start = time.perf_counter()
    # the harness enters the lowering speed-ups around each lowering call, never the export
    with chatter_kept_off_stdout(options.capture):
        model = ref.load()
        gated = {"alone": gate.alone, "between": gate.between} if gate else {}
        rows = report.evaluate(
            model,
            timing=options.timing,
            npu=options.npu,
            debug=options.debug,
            peers=options.peers,
            **gated,
        )
    return rows, time.perf_counter() - start


_gate: TimingGate | None = None


def _start_worker(gate: TimingGate, verbose: bool) -> None:
    global _gate
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends us
    _gate = gate
    if verbose:
        from etfold.decisions import set_log_level

        set_log_level("INFO")
    with chatter_kept_off_stdout(True):
        import etfold.harness.xnnpack_runner  # noqa: F401
        import etfold.report  # noqa: F401  (what every task needs, imported while the pool starts)


def _evaluate_in_worker(ref: ModelRef, options: RunOptions) -> tuple[list[Outcome], float]:
    assert _gate is not None, "not started by run_models"
    with _gate.working():
        return evaluate(ref, options, _gate)


Started = Callable[[ModelRef], None]
Finished = Callable[[ModelRef, list, float], None]


def run_models(
    refs: Sequence[ModelRef],
    options: RunOptions,
    jobs: int,
    *,
    started: Started,
    finished: Finished,
    tick: Callable[[], None] = lambda: None,
    tick_s: float = 1.0,
) -> None:
    """Evaluate every model, `jobs` at a time, calling back in completion order.

    With one job (or one model) everything runs in this process.
    """
    jobs = max(1, min(jobs, len(refs)))
    if jobs == 1:
        for ref in refs:
            started(ref)
            tick()
            finished(ref, *evaluate(ref, options))
        return
    context = multiprocessing.get_context("spawn")
    gate = TimingGate(context, jobs)
    pool = ProcessPoolExecutor(
        jobs, mp_context=context, initializer=_start_worker, initargs=(gate, options.verbose)
    )
    try:
        _schedule(pool, refs, options, jobs, started, finished, tick, tick_s)
    except BaseException:
        _terminate(pool)
        raise
    # the workers exit on their own (their interpreters take seconds to tear down torch);
    # the report is complete without waiting for them, and the process exit joins them
    pool.shutdown(wait=False)


def _schedule(pool, refs, options, jobs, started, finished, tick, tick_s) -> None:
    """Keep `jobs` models in flight (so the caller knows which ones run), in order."""
    waiting = list(refs)
    running: dict[Future, ModelRef] = {}
    while waiting or running:
        while waiting and len(running) < jobs:
            ref = waiting.pop(0)
            running[pool.submit(_evaluate_in_worker, ref, options)] = ref
            started(ref)
        tick()
        done, _ = wait(running, timeout=tick_s, return_when=FIRST_COMPLETED)
        for future in done:
            ref = running.pop(future)
            finished(ref, *future.result())


def _terminate(pool: ProcessPoolExecutor) -> None:
    """Stop the workers now: interrupted, or a failure that ends the report."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    for process in processes:
        process.join()
