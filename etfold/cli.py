# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Command line: `etfold report`.

Imports stay lazy: `etfold --help` and `etfold report --list` never import torch.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import TextIO

from etfold import demo_models

EXIT_OK = 0
EXIT_FAILED = 1  # a lowering or a run failed (the table shows which)
EXIT_USAGE = 2  # a bad argument or input file

_EPILOG = """\
exit status: 0 every lowering and run succeeded; 1 a lowering or run failed
(its row says where); 2 a bad argument or input file (one line on stderr).
Third-party warnings and runtime messages are hidden unless --verbose;
--debug adds tracebacks. Models whose optional dependencies are missing are
skipped with a line naming the extra that installs them.
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


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="etfold", epilog=_EPILOG)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    rep = commands.add_parser(
        "report",
        help="lower with stock ExecuTorch and with etfold, run both, compare",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rep.add_argument("--backend", choices=["xnnpack", "arm"], help="only models for this backend")
    rep.add_argument("--model", action="append", help="a built-in model by name (repeatable)")
    rep.add_argument(
        "--program", help="a user's exported program (.pt2, saved with example inputs)"
    )
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
    rep.add_argument("--json", action="store_true", help="print JSON instead of a table")
    rep.add_argument("--list", action="store_true", help="list the built-in models and exit")
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
    if as_json:
        rows = [
            {
                "name": e.name,
                "backend": e.backend,
                "description": e.description,
                "missing_extras": list(e.missing_extras()),
            }
            for e in entries
        ]
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    for e in entries:
        missing = e.missing_extras()
        needs = f"  [needs {_extras_text(missing)}]" if missing else ""
        print(f"{e.name:28s} {e.backend:8s} {e.description}{needs}")
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
    selected = [known[n] for n in dict.fromkeys(args.model)] if args.model else entries
    return [e for e in selected if args.backend in (None, e.backend)]


class _UsageError(Exception):
    pass


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


@contextlib.contextmanager
def _chatter_captured(enabled: bool) -> Iterator[None]:
    """Send Python warnings, logging and C-level runtime output to a scratch file."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile() as scratch:
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        text = open(scratch.fileno(), "w", closefd=False, encoding="utf-8", errors="replace")  # noqa: SIM115
        try:
            for fd in saved:
                os.dup2(scratch.fileno(), fd)
            with (
                contextlib.redirect_stdout(text),
                contextlib.redirect_stderr(text),
                warnings.catch_warnings(),
            ):
                warnings.simplefilter("ignore")
                yield
        finally:
            text.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)


def _outcome_line(outcomes) -> str:
    failed = [o for o in outcomes if o.failure]
    if not failed:
        return "ok"
    texts = {o.failure for o in failed}
    who = " and ".join(o.flavour for o in failed)
    if len(texts) == 1:
        return f"FAILED ({who}): {failed[0].failure}"
    return "FAILED: " + "; ".join(f"{o.flavour}: {o.failure}" for o in failed)


def _run_models(models, args, progress: TextIO) -> list:
    from etfold import report

    plan = report.TimingPlan(budget_s=args.budget, min_rounds=args.runs)
    outcomes = []
    for index, model in enumerate(models, 1):
        start = time.perf_counter()
        print(f"[{index}/{len(models)}] {model.name} ({model.backend}) … ", end="", file=progress)
        progress.flush()
        with _chatter_captured(not (args.verbose or args.debug)):
            rows = report.evaluate(model, timing=plan, npu=not args.no_npu, debug=args.debug)
        elapsed = time.perf_counter() - start
        print(f"{elapsed:.1f} s, {_outcome_line(rows)}", file=progress, flush=True)
        outcomes += rows
    return outcomes


def _models_to_run(args, progress: TextIO) -> list:
    from etfold import report

    if args.program:
        if args.model:
            raise _UsageError("give --program or --model, not both")
        backend = args.backend or "xnnpack"
        entry = demo_models.CatalogueEntry(args.program, backend, "", "")
        if entry.missing_extras():
            raise _UsageError(f"--backend {backend} needs {_extras_text(entry.missing_extras())}")
        with _chatter_captured(not (args.verbose or args.debug)):
            report.load_user_program(args.program)  # bad input fails here, before any lowering
        return [report.user_program(args.program, backend)]
    entries = _skip_unavailable(_select(args, demo_models.catalogue()), progress)
    with _chatter_captured(not (args.verbose or args.debug)):
        return demo_models.load(entries)


def _report(args) -> int:
    if args.list:
        return _list(demo_models.catalogue(), args.json)
    from etfold import report
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

    if args.json:
        print(json.dumps(_json_safe(report.as_json_rows(outcomes)), indent=2))
    elif outcomes:
        print(report.format_table(outcomes, explain=args.explain))
    return EXIT_FAILED if any(o.failure for o in outcomes) else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "report":
            return _report(args)
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
