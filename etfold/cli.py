# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Command line: `etfold report` and `etfold lower`.

Imports stay lazy: `etfold --help`, `--version`, `etfold report --list` and a
missing or unreadable input file never import torch.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import math
import os
import shutil
import sys
import time
import zipfile
from collections.abc import Iterator
from typing import TextIO

from etfold import __version__, demo_models, versions

EXIT_OK = 0
EXIT_FAILED = 1  # a lowering or a run failed (the table shows which)
EXIT_USAGE = 2  # a bad argument or input file

_EPILOG = """\
exit status: 0 every lowering and run succeeded; 1 a lowering or run failed
(its row says where; a peer's failure shows in its own row and does not count);
2 a bad argument or input file (one line on stderr).
Third-party warnings and runtime messages are hidden unless --verbose;
--debug adds tracebacks. Models whose optional dependencies are missing are
skipped with a line naming the extra that installs them.
"""

_LOWER_EPILOG = """\
exit status: 0 the .pte was written; 1 the lowering failed (one line names the
error); 2 a bad argument or input file (one line on stderr). --debug adds the
traceback. The summary goes to stdout, warnings to stderr.
"""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) and the documented exit code."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    value = int(text) if text.lstrip("-").isdigit() else None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


# runtimes `etfold report --peer` times beside stock and etfold (etfold.harness.onnx_peer.PEERS)
PEERS = ("ort",)

# `etfold lower` targets (etfold.lowering.TARGETS, named here so --help imports nothing)
LOWER_TARGETS = ("xnnpack", "tosa-int", "tosa-fp", "ethos-u55", "ethos-u85")
DEFAULT_RANDOM_CALIBRATION = 16


def _non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(text)


def _add_calibration(parser: argparse.ArgumentParser, where: str) -> None:
    parser.add_argument(
        "--calibration",
        metavar="FILE",
        help=f"{where}: calibrate on the input tuples saved in FILE "
        "(torch.save([(x1, ...), ...], FILE))",
    )
    parser.add_argument(
        "--random-calibration",
        metavar="N",
        type=_non_negative_int,
        default=DEFAULT_RANDOM_CALIBRATION,
        help=f"{where}, without --calibration: calibrate on N random inputs "
        f"(default {DEFAULT_RANDOM_CALIBRATION}); a warning says the error is then not meaningful",
    )


def _lower_parser(commands) -> None:
    low = commands.add_parser(
        "lower",
        help="write etfold's .pte for a saved ExportedProgram, with a summary of what folded",
        epilog=_LOWER_EPILOG,
    )
    low.add_argument("program", metavar="PROGRAM.pt2", help="torch.export.save(program, path)")
    low.add_argument(
        "--backend", choices=LOWER_TARGETS, default="xnnpack", help="(default xnnpack)"
    )
    low.add_argument("-o", "--output", required=True, metavar="OUT.pte", help="where to write")
    _add_calibration(low, "tosa-int and ethos-u targets")
    low.add_argument("--explain", action="store_true", help="list every fold decision")
    low.add_argument(
        "--verbose", action="store_true", help="show third-party warnings and runtime messages"
    )
    low.add_argument("--debug", action="store_true", help="print the traceback of a failure")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="etfold", epilog=_EPILOG)
    parser.add_argument(
        "--version",
        action="version",
        version=f"etfold {__version__} (supports {versions.supported_text()})",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _lower_parser(commands)
    rep = commands.add_parser(
        "report",
        help="lower with stock ExecuTorch and with etfold, run both, compare",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rep.add_argument("--backend", choices=["xnnpack", "arm"], help="only models for this backend")
    rep.add_argument("--model", action="append", help="a built-in model by name (repeatable)")
    rep.add_argument(
        "--all",
        action="store_true",
        help="every built-in model (default: one per fold family and backend; --list marks them)",
    )
    rep.add_argument(
        "--program", help="a user's exported program (.pt2, saved with example inputs)"
    )
    _add_calibration(rep, "--program on arm")
    rep.add_argument(
        "--runs",
        type=_positive_int,
        default=10,
        help="XNNPACK latency: at least this many interleaved timing rounds (default 10)",
    )
    rep.add_argument(
        "--budget",
        type=_positive_float,
        default=1.0,
        help="XNNPACK latency: keep timing for this many seconds per model (default 1)",
    )
    rep.add_argument(
        "--no-npu", action="store_true", help="skip Vela's Ethos-U cycle estimates for Arm rows"
    )
    rep.add_argument(
        "--peer",
        choices=PEERS,
        action="append",
        help="XNNPACK rows: also run the same exported program on ort (ONNX Runtime, "
        "CPU, as many threads as ExecuTorch's), timed interleaved with stock and etfold; "
        "needs pip install 'etfold[peers]'",
    )
    rep.add_argument(
        "--jobs",
        type=_positive_int,
        default=2,
        help="models evaluated at once, each in a worker process (default 2); "
        "latency is still timed while nothing else runs",
    )
    rep.add_argument(
        "--json",
        action="store_true",
        help="print a JSON array instead of a table (a row a line, as each model finishes)",
    )
    rep.add_argument(
        "--jsonl", action="store_true", help="print JSON Lines: one object per row, as they finish"
    )
    rep.add_argument(
        "--list", action="store_true", help="list the built-in models (of --backend) and exit"
    )
    rep.add_argument(
        "--explain", action="store_true", help="list every fold decision, each with its node"
    )
    rep.add_argument(
        "--verbose",
        action="store_true",
        help="show third-party warnings, runtime messages and fold decisions as they happen",
    )
    rep.add_argument(
        "--debug", action="store_true", help="print tracebacks of failures (nothing is captured)"
    )
    return parser


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _list(entries, as_json: bool) -> int:
    """Every built-in model; `default` marks the ones a plain `etfold report` runs."""
    if as_json:
        rows = [
            {
                "name": e.name,
                "backend": e.backend,
                "description": e.description,
                "default": e.default,
                "missing_extras": list(e.missing_extras()),
            }
            for e in entries
        ]
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    for e in entries:
        missing = e.missing_extras()
        needs = f"  [needs {_extras_text(missing)}]" if missing else ""
        default = "default" if e.default else ""
        print(f"{e.name:28s} {e.backend:8s} {default:7s} {e.description}{needs}")
    return EXIT_OK


def _extras_text(extras) -> str:
    return ", ".join(f"pip install 'etfold[{x}]'" for x in extras)


def _select(args, entries) -> list:
    known = {e.name: e for e in entries}
    unknown = sorted(set(args.model or []) - set(known))
    if unknown:
        raise _UsageError(
            f"unknown model(s): {', '.join(unknown)}; `etfold report --list` names the built-in ones"
        )
    if args.model and args.all:
        raise _UsageError("give --model or --all, not both")
    if args.model:
        selected = [known[n] for n in dict.fromkeys(args.model)]
    else:  # XNNPACK first, as the table shows them: a streamed table changes section once
        selected = entries if args.all else [e for e in entries if e.default]
        selected = sorted(selected, key=lambda e: e.backend != "xnnpack")
    return [e for e in selected if args.backend in (None, e.backend)]


class _UsageError(Exception):
    pass


def _check_readable_file(path: str, what: str) -> None:
    """The checks that need no torch, so a mistyped path costs no torch import."""
    if not os.path.exists(path):
        raise _UsageError(f"{path}: no such file")
    if os.path.isdir(path):
        raise _UsageError(f"{path}: is a directory, expected {what}")


def _check_program_file(path: str) -> None:
    _check_readable_file(path, "a .pt2 file")
    if not zipfile.is_zipfile(path):
        raise _UsageError(
            f"{path}: not a readable .pt2 archive (truncated, or not written by "
            "torch.export.save(program, path))"
        )


def _calibration_source(args, quantized: bool, progress: TextIO):
    """Where an integer lowering's calibration samples come from; warns about random ones."""
    from etfold.calibration import RANDOM_CALIBRATION_WARNING, CalibrationSource

    if not quantized:
        return None
    if args.calibration is not None:
        return CalibrationSource(path=args.calibration)
    if args.random_calibration:
        warning = RANDOM_CALIBRATION_WARNING.format(count=args.random_calibration)
        print(f"etfold: warning: {warning}", file=progress, flush=True)
    return CalibrationSource(random_count=args.random_calibration)


def _skip_unavailable(entries, progress: TextIO) -> list:
    runnable, skipped = [], {}
    for e in entries:
        missing = e.missing_extras()
        if missing:
            skipped.setdefault(missing, []).append(e.name)
        else:
            runnable.append(e)
    for extras, names in skipped.items():
        print(
            f"skipped {', '.join(names)}: {_extras_text(extras)} to run "
            f"{'it' if len(names) == 1 else 'them'}",
            file=progress,
            flush=True,
        )
    return runnable


@contextlib.contextmanager
def _progress_stream() -> Iterator[TextIO]:
    """Where progress goes: the stderr the user sees, even while chatter is captured."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        yield sys.stderr
        return
    sys.stderr.flush()
    stream = os.fdopen(os.dup(fd), "w", buffering=1, encoding="utf-8", errors="replace")
    try:
        yield stream
    finally:
        stream.close()


def _outcome_line(outcomes) -> str:
    failed = [o for o in outcomes if o.failure]
    if not failed:
        return "ok"
    texts = {o.failure for o in failed}
    who = " and ".join(o.flavour for o in failed)
    if len(texts) == 1:
        return f"FAILED ({who}): {failed[0].failure}"
    return "FAILED: " + "; ".join(f"{o.flavour}: {o.failure}" for o in failed)


class _Progress:
    """stderr while models run.

    Each finished model: `[k/n] NAME (BACKEND) … T s, OUTCOME` (k counts
    finished models). What runs now: `running: A (12 s), B (3 s); k of n done,
    w waiting`, one line rewritten in place on a terminal; elsewhere (a log)
    printed without times whenever the running set changes, when there is more
    than one model.
    """

    def __init__(self, stream: TextIO, total: int):
        self._stream, self._total = stream, total
        self._done = 0
        self._running: dict[str, float] = {}
        self._live = stream.isatty()
        self._last = ""

    def started(self, ref) -> None:
        self._running[ref.name] = time.perf_counter()

    def finished(self, ref, outcomes, elapsed: float) -> None:
        self._done += 1
        self._running.pop(ref.name, None)
        self.clear()
        line = f"[{self._done}/{self._total}] {ref.name} ({ref.backend}) … {elapsed:.1f} s"
        print(f"{line}, {_outcome_line(outcomes)}", file=self._stream, flush=True)

    def status(self, timed: bool) -> str:
        now = time.perf_counter()
        names = [f"{n} ({now - t:.0f} s)" if timed else n for n, t in self._running.items()]
        waiting = self._total - self._done - len(self._running)
        return f"running: {', '.join(names)}; {self._done} of {self._total} done, {waiting} waiting"

    def tick(self) -> None:
        if not self._running:
            return
        if self._live:
            width = shutil.get_terminal_size().columns - 1
            self._stream.write("\r\x1b[K" + self.status(timed=True)[:width])
            self._stream.flush()
            self._last = "live"
        elif self._total > 1 and self.status(timed=False) != self._last:
            self._last = self.status(timed=False)
            print(self._last, file=self._stream, flush=True)

    def clear(self) -> None:
        if self._live and self._last:
            self._stream.write("\r\x1b[K")
            self._stream.flush()
            self._last = ""


class _Rows:
    """stdout as models finish: table rows, a JSON array (a row a line, each after the
    first led by its comma), or JSON Lines."""

    def __init__(self, mode: str, names: list[str], explain: bool, peers: bool = False):
        from etfold import report

        self.outcomes: list = []
        self._mode = mode
        width = max(map(len, names), default=0)
        self._table = report.TableStream(width, explain=explain, peers=peers)
        if mode == "json":
            self._write("[\n")

    def add(self, outcomes) -> None:
        from etfold import report

        rows = [json.dumps(_json_safe(r)) for r in report.as_json_rows(outcomes)]
        if self._mode == "table":
            text = "".join(f"{line}\n" for line in self._table.add(outcomes))
        elif self._mode == "json":  # comma first: every line is complete when written
            lead = [" " if not self.outcomes and i == 0 else "," for i in range(len(rows))]
            text = "".join(f"{c}{r}\n" for c, r in zip(lead, rows, strict=True))
        else:
            text = "".join(f"{r}\n" for r in rows)
        self.outcomes += outcomes
        self._write(text)

    def close(self) -> None:
        if self._mode == "table":
            self._write("".join(f"{line}\n" for line in self._table.close()))
        elif self._mode == "json":
            self._write("]\n")

    @staticmethod
    def _write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()


def _run_models(refs, args, stream: TextIO) -> list:
    from etfold import report, report_workers

    options = report_workers.RunOptions(
        report.TimingPlan(budget_s=args.budget, min_rounds=args.runs),
        npu=not args.no_npu,
        debug=args.debug,
        capture=not (args.verbose or args.debug),
        verbose=args.verbose,
        peers=_peers(args),
    )
    mode = "jsonl" if args.jsonl else "json" if args.json else "table"
    progress = _Progress(stream, len(refs))
    rows = _Rows(mode, [r.name for r in refs], args.explain, bool(options.peers))

    def finished(ref, outcomes, elapsed):
        progress.finished(ref, outcomes, elapsed)
        rows.add(outcomes)

    try:
        report_workers.run_models(
            refs,
            options,
            args.jobs,
            started=progress.started,
            finished=finished,
            tick=progress.tick,
        )
    finally:
        progress.clear()
        rows.close()
    return rows.outcomes


def _models_to_run(args, progress: TextIO) -> list:
    from etfold import report, report_workers

    if args.program:
        if args.model or args.all:
            raise _UsageError(f"give --program or {'--model' if args.model else '--all'}, not both")
        backend = args.backend or "xnnpack"
        _check_needs(backend)
        calibration = _calibration_source(args, backend == "arm", progress)
        with report_workers.chatter_kept_off_stdout(not (args.verbose or args.debug)):
            program = report.load_user_program(args.program)  # bad input fails here, before
            if calibration is not None:  # any lowering
                calibration.samples(program)
        ref = report_workers.ModelRef(
            args.program, backend, program=args.program, calibration=calibration
        )
        return [ref]
    entries = _skip_unavailable(_select(args, demo_models.catalogue()), progress)
    return [report_workers.ModelRef.of_entry(e) for e in entries]


def _peers(args) -> tuple[str, ...]:
    return tuple(dict.fromkeys(args.peer or ()))


def _check_peers(args) -> None:
    """A peer runs beside XNNPACK rows, and only with its packages installed."""
    if not args.peer:
        return
    if args.backend == "arm" or (args.program and args.backend not in (None, "xnnpack")):
        raise _UsageError("--peer times CPU runtimes beside XNNPACK rows: give --backend xnnpack")
    from etfold.harness import onnx_peer

    missing = onnx_peer.unavailable_text()
    if missing is not None:
        raise _UsageError(missing)


def _check_needs(backend: str) -> None:
    """The extras a backend's lowering needs, before anything is loaded."""
    entry = demo_models.CatalogueEntry("", backend, "", "")
    if entry.missing_extras():
        raise _UsageError(f"--backend {backend} needs {_extras_text(entry.missing_extras())}")


def _check_input_files(args) -> None:
    if args.command == "lower":
        _check_program_file(args.program)
        output = os.path.dirname(os.path.abspath(args.output))
        if os.path.isdir(args.output) or not os.path.isdir(output):
            raise _UsageError(f"{args.output}: cannot write there (a directory, or no such folder)")
    elif args.program and not (args.model or args.all):  # else the combination is the error
        _check_program_file(args.program)
    if args.calibration is not None:
        _check_readable_file(args.calibration, "a .pt file of input tuples")


def _report(args) -> int:
    if args.list:
        entries = demo_models.catalogue()
        return _list([e for e in entries if args.backend in (None, e.backend)], args.json)
    if args.json and args.jsonl:
        raise _UsageError("give --json or --jsonl, not both")
    if args.calibration is not None and not (args.program and args.backend == "arm"):
        raise _UsageError("--calibration applies to --program with --backend arm")
    _check_peers(args)
    from etfold.decisions import set_log_level

    if args.verbose:
        set_log_level("INFO")
    try:
        with _progress_stream() as progress:
            models = _models_to_run(args, progress)
            outcomes = _run_models(models, args, progress)
    finally:
        if args.verbose:
            set_log_level(None)
    failed = any(o.failure for o in outcomes if o.flavour not in _peers(args))
    return EXIT_FAILED if failed else EXIT_OK


def _lower(args) -> int:
    """Lower a user's saved program with etfold, write the .pte, print the summary."""
    from etfold import lowering, report, report_workers

    target = args.backend
    _check_needs(lowering.REPORT_BACKEND[target])
    if target.startswith("ethos-u") and importlib.util.find_spec("ethosu") is None:
        raise _UsageError(f"--backend {target} needs Vela: {_extras_text(['arm'])}")
    capture = not (args.verbose or args.debug)
    with _progress_stream() as progress:
        calibration = _calibration_source(args, target in lowering.QUANTIZED_TARGETS, progress)
        with report_workers.chatter_kept_off_stdout(capture):
            program = report.load_user_program(args.program)
            samples = calibration.samples(program) if calibration else []
            try:
                lowered = lowering.lower_program(program, target, samples)
            except report.UserInputError:
                raise
            except Exception as error:
                if args.debug:
                    raise
                failure = report.failure_text(error)
            else:
                failure = None
    if failure is not None:
        print(f"etfold: lowering failed: {failure} (--debug shows the traceback)", file=sys.stderr)
        return EXIT_FAILED
    lowered.write(args.output)
    for line in lowering.summary(lowered, explain=args.explain):
        print(line)
    print(f"wrote {args.output}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check_input_files(args)
        if args.command == "report":
            return _report(args)
        if args.command == "lower":
            return _lower(args)
    except BrokenPipeError:  # the reader went away (`etfold report --list | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt:
        print("etfold: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        from etfold.report import UserInputError, failure_text

        if getattr(args, "debug", False):
            import traceback

            traceback.print_exc(file=sys.stderr)
        if isinstance(error, UserInputError | _UsageError):
            print(f"etfold: error: {error}", file=sys.stderr)
            return EXIT_USAGE
        print(f"etfold: {failure_text(error)} (--debug shows the traceback)", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
