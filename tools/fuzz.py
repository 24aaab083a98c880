# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The long differential fuzzing profile: `make fuzz` (or `python tools/fuzz.py`).

Draws cases for the fold families from the strategies in
`etfold.harness.fuzz_strategies`, runs each through `etfold.harness.differential`
(stock ExecuTorch vs etfold on the real runtimes) and prints one summary line
per family: cases, wrong, crashes (etfold only / both), mutations, timeouts.

Case i of a family is drawn from its own random stream, seeded by (seed,
family, i), so a run is reproducible and resumable: results are appended to
STATE_DIR/<family>-seed<seed>.jsonl, and a rerun with the same seed continues
after the last recorded case. `--budget` (minutes) stops starting new cases;
`--timeout` (seconds) bounds one case. Exit status is 1 when any family has a
wrong program, an etfold-only crash or a mutation that is not a known pending
fix, else 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAMILY_NAMES = ("weight_fold", "converts", "scalar_mul", "dyt", "upstream_folds")


class CaseTimeout(BaseException):  # not an Exception: the harness must not classify it as a crash
    pass


def _on_alarm(signum, frame):
    raise CaseTimeout


_in_flight_marker: Path | None = None  # the in-flight marker of the case running now


def _on_terminate(signum, frame):
    """Stopped, not crashed: exit at once and record nothing, so the in-flight case runs
    again on resume. Not an exception: one raised from a signal handler can land in a
    finalizer or a catch-all, which swallows it, and the run would go on."""
    if _in_flight_marker is not None:
        _in_flight_marker.unlink(missing_ok=True)
    sys.stdout.flush()
    os._exit(128 + signum)


# how a worker dies on a native crash in a runtime (SIGKILL: the kernel's OOM killer)
NATIVE_CRASH_SIGNALS = frozenset(
    {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGKILL}
)


def _provider_blind_to_source_constants():
    """Hypothesis's provider, minus the constants it collects from the source of the modules
    the process has loaded: with those, a draw depends on what was imported before it."""
    from hypothesis.internal.conjecture.choice import choice_permitted
    from hypothesis.internal.conjecture.providers import GLOBAL_CONSTANTS, HypothesisProvider

    class Provider(HypothesisProvider):
        def _maybe_draw_constant(self, choice_type, constraints, *, p=0.05):
            if self._random.random() > p:
                return None
            allowed = [
                c
                for c in GLOBAL_CONSTANTS.set_for_type(choice_type)
                if choice_permitted(c, constraints)
            ]
            return self._random.choice(sorted(allowed, key=repr)) if allowed else None

    return Provider


def draw_case(family: str, seed: int, index: int):
    """Case `index` of `family` for `seed`: the same case on every run, in any process."""
    from hypothesis.control import BuildContext
    from hypothesis.internal.conjecture.data import ConjectureData

    from etfold.harness import fuzz_strategies

    digest = hashlib.sha256(f"{seed}:{family}:{index}".encode()).digest()
    data = ConjectureData(
        random=random.Random(int.from_bytes(digest[:8], "little")),
        provider=_provider_blind_to_source_constants(),
    )
    with BuildContext(data, is_final=True, wrapped_test=draw_case):
        return data.draw(fuzz_strategies.FAMILIES[family])


def _state_file(state_dir: Path, family: str, seed: int) -> Path:
    return state_dir / f"{family}-seed{seed}.jsonl"


def _inflight(state_dir: Path, family: str, seed: int) -> Path:
    return state_dir / f"{family}-seed{seed}.inflight"


def _recover(state_dir: Path, family: str, seed: int, records: list[dict]) -> None:
    """A case that was started and never recorded took the process down (a native crash in
    a runtime): record it as such, so a resumed run moves past it instead of retrying it."""
    marker = _inflight(state_dir, family, seed)
    if not marker.exists():
        return
    index = int(marker.read_text())
    if index == len(records):
        record = {"verdict": "process_crash", "detail": "the process died running this case"}
        record.update(index=index, case=repr(draw_case(family, seed, index)), seconds=None)
        records.append(record)
        with _state_file(state_dir, family, seed).open("a") as out:
            out.write(json.dumps(record) + "\n")
    marker.unlink()


def _recorded(path: Path) -> list[dict]:
    """The records of a state file, one per case index. A case recorded as a process crash
    and then run to a verdict (a crash record written by a second run sharing the state, from
    before the lock) counts by its verdict; a case run again by --recheck counts by its last run."""
    if not path.exists():
        return []
    by_index: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            earlier = by_index.get(record["index"], {}).get("verdict")
            if earlier in (None, "process_crash") or record.get("recheck"):
                by_index[record["index"]] = record
    return [by_index[i] for i in sorted(by_index)]


def _lock_families(state_dir: Path, families: list[str], seed: int) -> list:
    """Hold an exclusive lock on each family's state for this run: two runs appending to one
    state file would each take the other's in-flight case for a native crash."""
    import fcntl

    held = []
    for family in families:
        handle = (state_dir / f"{family}-seed{seed}.lock").open("w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(
                f"another fuzz run is using {state_dir} for {family}, seed {seed}"
            ) from None
        held.append(handle)
    return held


def _source_revision() -> str:
    """The commit the cases ran on (with '-dirty' for uncommitted changes), for the record."""
    import subprocess

    described = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    return described.stdout.strip() or "unknown"


def run_one(family: str, seed: int, index: int, timeout: int) -> dict:
    from etfold.harness.differential import run_case
    from etfold.harness.verdicts import known_pending, known_upstream

    case = draw_case(family, seed, index)
    started = time.monotonic()
    signal.alarm(timeout)
    try:
        outcome = run_case(case)
        record = {
            "verdict": outcome.verdict,
            "detail": outcome.detail,
            "known_pending": known_pending(case, outcome),
            "known_upstream": known_upstream(outcome.detail)
            if outcome.verdict in ("crash_both", "crash_stock")
            else None,
            "etfold_error": outcome.etfold_error,
            "baseline_error": outcome.baseline_error,
        }
    except CaseTimeout:
        record = {"verdict": "timeout", "detail": f"over {timeout} s"}
    except Exception as error:  # the runner itself failed on this case: keep going, say so
        record = {"verdict": "harness_error", "detail": traceback.format_exc(limit=3)[-500:]}
        record["error"] = repr(error)[:300]
    finally:
        signal.alarm(0)
    record.update(index=index, case=repr(case), seconds=round(time.monotonic() - started, 2))
    return record


STALE = "stale"  # --recheck: the cases whose draw changed since they were recorded


def _spells(case_repr: str, field_token: str) -> bool:
    """`case_repr` has the field `name=value` exactly (not as the prefix of a longer value)."""
    return f"{field_token}," in case_repr or f"{field_token})" in case_repr


def _draw_changed(record: dict, family: str, seed: int) -> bool:
    """The recorded case is not the one drawn today. A field the record predates counts as
    its default, so adding a field with a default leaves the cases that keep it current."""
    import dataclasses

    case = draw_case(family, seed, record["index"])
    recorded = record["case"]
    for field in dataclasses.fields(case):
        value = getattr(case, field.name)
        if _spells(recorded, f"{field.name}={value!r}"):
            continue
        if f"{field.name}=" not in recorded and value == field.default:
            continue
        return True
    return False


def _to_recheck(record: dict, tokens: list[str], family: str, seed: int) -> bool:
    """A token is a verdict, STALE, or `field=value` as the case's repr spells it."""
    if any(_spells(record["case"], t) for t in tokens if "=" in t):
        return True
    if record["verdict"] in tokens:
        return True
    return STALE in tokens and _draw_changed(record, family, seed)


def _recheck(args, family: str, records: list[dict], revision: str, deadline) -> None:
    """Run again, on this revision, the recorded cases --recheck names: by verdict (after a
    fix, or a fix of the oracle), STALE (drawn differently today: after a generator change)
    or a case field (`share=True`: after a change to a guard); the new record replaces
    the old one."""
    state = _state_file(args.state_dir, family, args.seed)
    for position, old in enumerate(records):
        if not _to_recheck(old, args.recheck, family, args.seed):
            continue
        if deadline is not None and time.monotonic() > deadline:
            return
        record = run_one(family, args.seed, old["index"], args.timeout)
        record.update(revision=revision, recheck=True, rechecked_verdict=old["verdict"])
        records[position] = record
        with state.open("a") as out:
            out.write(json.dumps(record) + "\n")
        print(f"[{family} #{old['index']}] {old['verdict']} -> {record['verdict']}", flush=True)


def summary_line(family: str, records: list[dict], seed: int) -> str:
    verdicts = Counter(r["verdict"] for r in records)
    pending = sum(1 for r in records if r.get("known_pending"))
    wrong = verdicts["wrong"]
    return (
        f"{family:<12} seed {seed}: cases {len(records)}, wrong {wrong - _pending(records, 'wrong')}"
        f" (+{_pending(records, 'wrong')} known pending), crashes"
        f" {verdicts['crash_etfold']} etfold only / {verdicts['crash_both']} both,"
        f" mutations {verdicts['mutation']}, timeouts {verdicts['timeout']};"
        f" more delegates {verdicts['more_delegates'] - _pending(records, 'more_delegates')},"
        f" upstream wrong {verdicts['upstream_wrong']} (stock alone {verdicts['stock_wrong']}),"
        f" stock alone crashed {verdicts['crash_stock']},"
        f" harness errors {verdicts['harness_error']},"
        f" process crashes {verdicts['process_crash']},"
        f" known pending total {pending}"
    )


def _pending(records: list[dict], verdict: str) -> int:
    return sum(1 for r in records if r["verdict"] == verdict and r.get("known_pending"))


def failed(records: list[dict]) -> bool:
    hard = ("wrong", "crash_etfold", "mutation", "more_delegates", "process_crash")
    return any(r["verdict"] in hard and not r.get("known_pending") for r in records)


def _worker_argv(argv: list[str], families: list[str]) -> list[str]:
    """`argv` for one worker: its families, no --jobs/--families of the supervisor's."""
    kept, skip = [], False
    for arg in argv:
        if skip and not arg.startswith("--"):
            continue
        skip = arg in ("--families", "--jobs")
        if not skip:
            kept.append(arg)
    return [*kept, "--worker", "--families", *families]


def _run_until_done(argv: list[str]) -> None:
    """Run a worker; when a native crash kills it, start it again: it records the case
    that took it down (process_crash) and goes on with the next."""
    import subprocess

    while -subprocess.run([sys.executable, __file__, *argv]).returncode in NATIVE_CRASH_SIGNALS:
        print("[fuzz] a worker died on a native crash; resuming after that case", flush=True)


def supervise(argv: list[str], args) -> None:
    import threading

    shares = [args.families[i :: args.jobs] for i in range(min(args.jobs, len(args.families)))]
    workers = [
        threading.Thread(target=_run_until_done, args=(_worker_argv(argv, share),))
        for share in shares
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def main(argv: list[str] | None = None) -> int:
    global _in_flight_marker
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=2000, help="total over the families")
    parser.add_argument("--budget", type=float, default=None, help="minutes; then stop")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per case")
    parser.add_argument("--families", nargs="+", default=list(FAMILY_NAMES), choices=FAMILY_NAMES)
    parser.add_argument("--state-dir", type=Path, default=ROOT / ".fuzz")
    parser.add_argument("--summary-only", action="store_true", help="print the recorded summary")
    parser.add_argument(
        "--recheck",
        nargs="+",
        default=[],
        metavar="VERDICT|stale|FIELD=VALUE",
        help="first run again the recorded cases with these verdicts (after a fix);"
        f" {STALE!r}: the cases drawn differently since (after a generator change);"
        " FIELD=VALUE: the cases with that field, as their repr spells it (share=True)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="worker processes, each running its share of the families and restarted after a"
        " native crash (0: run in this process)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.jobs > 0 and not args.worker and not args.summary_only:
        supervise(argv if argv is not None else sys.argv[1:], args)
        args.summary_only = True

    args.state_dir.mkdir(parents=True, exist_ok=True)
    per_family = -(-args.cases // len(args.families))
    deadline = None if args.budget is None else time.monotonic() + 60 * args.budget
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGTERM, _on_terminate)
    locks = [] if args.summary_only else _lock_families(args.state_dir, args.families, args.seed)
    revision = None if args.summary_only else _source_revision()
    records = {f: _recorded(_state_file(args.state_dir, f, args.seed)) for f in args.families}
    for family in [] if args.summary_only else args.families:  # a summary only reads
        _recover(args.state_dir, family, args.seed, records[family])
        _recheck(args, family, records[family], revision, deadline)
    # round-robin over the families, so a budget cut leaves every family sampled
    while not args.summary_only:
        pending = [f for f in args.families if len(records[f]) < per_family]
        if not pending or (deadline is not None and time.monotonic() > deadline):
            break
        family = min(pending, key=lambda f: len(records[f]))
        marker = _inflight(args.state_dir, family, args.seed)
        marker.write_text(str(len(records[family])))
        _in_flight_marker = marker
        try:
            record = run_one(family, args.seed, len(records[family]), args.timeout)
        except SystemExit:  # terminated: the case runs again on resume
            marker.unlink(missing_ok=True)
            raise
        finally:
            _in_flight_marker = None
        record["revision"] = revision
        records[family].append(record)
        with _state_file(args.state_dir, family, args.seed).open("a") as out:
            out.write(json.dumps(record) + "\n")
        marker.unlink(missing_ok=True)
        if record["verdict"] not in ("ok", "upstream_wrong", "stock_wrong", "crash_both"):
            print(f"[{family} #{record['index']}] {record['verdict']}: {record['detail']}")
            print(f"    {record['case']}", flush=True)
    for family in args.families:
        print(summary_line(family, records[family], args.seed))
    for handle in locks:
        handle.close()
    return 1 if any(failed(r) for r in records.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
