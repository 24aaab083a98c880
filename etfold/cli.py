"""Command line: `etfold report`."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys

from etfold import report
from etfold.demo_models import all_models


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="etfold")
    commands = parser.add_subparsers(dest="command", required=True)
    rep = commands.add_parser(
        "report", help="lower with stock ExecuTorch and with etfold, run both, compare"
    )
    rep.add_argument("--backend", choices=["xnnpack", "arm"], help="only models for this backend")
    rep.add_argument("--model", action="append", help="a built-in model by name (repeatable)")
    rep.add_argument(
        "--program", help="a user's exported program (.pt2, saved with example inputs)"
    )
    rep.add_argument(
        "--runs", type=int, default=5, help="timed runs per lowering, after one warm-up"
    )
    rep.add_argument("--json", action="store_true", help="print JSON rows instead of the table")
    rep.add_argument("--list", action="store_true", help="list the built-in models and exit")
    return parser


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _report(args) -> int:
    models = all_models()
    if args.list:
        for m in models:
            print(f"{m.name:28s} {m.backend:8s} {m.description}")
        return 0
    if args.program:
        selected = [report.user_program(args.program, args.backend or "xnnpack")]
    else:
        known = {m.name: m for m in models}
        unknown = sorted(set(args.model or []) - set(known))
        if unknown:
            _progress(f"unknown model(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
            return 2
        selected = [known[n] for n in args.model] if args.model else models
        selected = [m for m in selected if args.backend in (None, m.backend)]
    outcomes = []
    for index, model in enumerate(selected, 1):
        _progress(
            f"[{index}/{len(selected)}] {model.name} on {model.backend}: "
            "lowering with stock ExecuTorch and with etfold…"
        )
        outcomes += report.evaluate(model, runs=args.runs)
    if args.json:
        rows = report.as_json_rows(outcomes)
        for row in rows:  # JSON has no NaN
            row.update({k: None for k, v in row.items() if isinstance(v, float) and math.isnan(v)})
        print(json.dumps(rows, indent=2))
    else:
        print(report.format_table(outcomes))
    return 1 if any(o.failure for o in outcomes) else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.command == "report":
        return _report(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
