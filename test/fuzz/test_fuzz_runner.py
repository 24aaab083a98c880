# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""tools/fuzz.py, the long profile: reproducible draws, resume, budget, summary lines.

The case runner is replaced by a recorder here (the differential runs themselves
are the family tests); everything around it is the real tool.
"""

import importlib.util
import json
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "fuzz.py"


@pytest.fixture
def fuzz():
    spec = importlib.util.spec_from_file_location("etfold_fuzz_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_case_i_of_a_family_is_the_same_on_every_run_and_differs_by_seed_and_index(fuzz):
    for family in fuzz.FAMILY_NAMES:
        first = fuzz.draw_case(family, 7, 3)
        assert first == fuzz.draw_case(family, 7, 3)
        assert type(first).family == family
    draws = {repr(fuzz.draw_case("dyt", seed, index)) for seed in (0, 1) for index in range(4)}
    assert len(draws) == 8


def _recorder(fuzz, monkeypatch, verdicts):
    ran = []

    def run_one(family, seed, index, timeout):
        ran.append((family, index))
        verdict = verdicts.get((family, index), "ok")
        return {"verdict": verdict, "detail": "", "index": index, "case": f"{family}{index}"}

    monkeypatch.setattr(fuzz, "run_one", run_one)
    return ran


def test_a_rerun_with_the_same_seed_resumes_after_the_last_recorded_case(
    fuzz, monkeypatch, tmp_path, capsys
):
    ran = _recorder(fuzz, monkeypatch, {("converts", 1): "crash_both"})
    args = ["--cases", "8", "--state-dir", str(tmp_path), "--seed", "5"]
    assert fuzz.main([*args, "--cases", "4"]) == 0
    assert sorted(ran) == [(f, 0) for f in sorted(fuzz.FAMILY_NAMES)]
    ran.clear()
    assert fuzz.main(args) == 0
    assert sorted(ran) == [(f, 1) for f in sorted(fuzz.FAMILY_NAMES)]
    lines = capsys.readouterr().out.splitlines()[-len(fuzz.FAMILY_NAMES) :]
    assert [line.split()[0] for line in lines] == list(fuzz.FAMILY_NAMES)
    converts = lines[fuzz.FAMILY_NAMES.index("converts")]
    assert "cases 2, wrong 0" in converts and "crashes 0 etfold only / 1 both" in converts
    recorded = (tmp_path / "converts-seed5.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in recorded] == [0, 1]


def test_a_wrong_program_fails_the_run_and_a_spent_budget_starts_nothing(
    fuzz, monkeypatch, tmp_path
):
    ran = _recorder(fuzz, monkeypatch, {("dyt", 0): "wrong"})
    assert fuzz.main(["--cases", "4", "--state-dir", str(tmp_path)]) == 1
    ran.clear()
    assert fuzz.main(["--cases", "40", "--state-dir", str(tmp_path), "--budget", "0"]) == 1
    assert ran == []


def test_a_case_that_killed_the_process_is_recorded_and_skipped_on_resume(
    fuzz, monkeypatch, tmp_path
):
    ran = _recorder(fuzz, monkeypatch, {})
    (tmp_path / "dyt-seed0.inflight").write_text("0")  # a run died inside dyt case 0
    assert fuzz.main(["--cases", "8", "--state-dir", str(tmp_path)]) == 1
    recorded = [json.loads(x) for x in (tmp_path / "dyt-seed0.jsonl").read_text().splitlines()]
    assert [(r["index"], r["verdict"]) for r in recorded] == [(0, "process_crash"), (1, "ok")]
    assert ("dyt", 0) not in ran and ("dyt", 1) in ran
    assert not list(tmp_path.glob("*.inflight"))


def test_a_case_run_after_a_stale_crash_record_counts_by_its_verdict(fuzz, tmp_path):
    lines = [
        {"index": 0, "verdict": "ok"},
        {"index": 1, "verdict": "process_crash"},
        {"index": 1, "verdict": "wrong"},
        {"index": 2, "verdict": "ok"},
    ]
    state = tmp_path / "dyt-seed0.jsonl"
    state.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [(r["index"], r["verdict"]) for r in fuzz._recorded(state)] == [
        (0, "ok"),
        (1, "wrong"),
        (2, "ok"),
    ]


def test_a_second_run_on_the_same_state_stops_with_one_clear_message(fuzz, monkeypatch, tmp_path):
    ran = _recorder(fuzz, monkeypatch, {})
    held = fuzz._lock_families(tmp_path, ["dyt"], 0)
    with pytest.raises(SystemExit, match="another fuzz run is using"):
        fuzz.main(["--cases", "4", "--state-dir", str(tmp_path), "--families", "dyt"])
    assert ran == []
    held[0].close()
    assert fuzz.main(["--cases", "4", "--state-dir", str(tmp_path), "--families", "dyt"]) == 0
    recorded = [json.loads(x) for x in (tmp_path / "dyt-seed0.jsonl").read_text().splitlines()]
    assert all(r["revision"] for r in recorded)


def test_a_summary_while_a_run_is_in_flight_records_nothing(fuzz, monkeypatch, tmp_path):
    _recorder(fuzz, monkeypatch, {})
    (tmp_path / "dyt-seed0.inflight").write_text("0")  # a live run is inside dyt case 0
    assert fuzz.main(["--summary-only", "--state-dir", str(tmp_path)]) == 0
    assert (tmp_path / "dyt-seed0.inflight").exists()
    assert not (tmp_path / "dyt-seed0.jsonl").exists()


def test_workers_split_the_families_and_keep_the_other_arguments(fuzz):
    argv = ["--seed", "3", "--jobs", "2", "--families", "dyt", "converts", "--budget", "5"]
    worker = fuzz._worker_argv(argv, ["dyt"])
    assert worker == ["--seed", "3", "--budget", "5", "--worker", "--families", "dyt"]


def test_a_worker_killed_by_a_native_crash_is_restarted_and_moves_past_the_case(
    fuzz, tmp_path, monkeypatch
):
    calls = []

    class Finished:
        def __init__(self, code):
            self.returncode = code

    def run(command):
        calls.append(command)
        return Finished(-11 if len(calls) == 1 else 0)

    import subprocess

    monkeypatch.setattr(subprocess, "run", run)
    fuzz._run_until_done(["--worker", "--families", "dyt"])
    assert len(calls) == 2 and calls[0] == calls[1]


def test_recheck_runs_the_cases_with_those_verdicts_again_and_counts_their_new_verdict(
    fuzz, monkeypatch, tmp_path, capsys
):
    ran = _recorder(fuzz, monkeypatch, {("dyt", 1): "wrong", ("dyt", 2): "upstream_wrong"})
    args = ["--cases", "3", "--state-dir", str(tmp_path), "--families", "dyt"]
    assert fuzz.main(args) == 1
    ran.clear()
    _recorder(fuzz, monkeypatch, {})  # the fix: every case is ok now
    assert fuzz.main([*args, "--recheck", "wrong"]) == 0
    assert "cases 3, wrong 0" in capsys.readouterr().out.splitlines()[-1]
    recorded = fuzz._recorded(tmp_path / "dyt-seed0.jsonl")
    assert [(r["index"], r["verdict"]) for r in recorded] == [
        (0, "ok"),
        (1, "ok"),
        (2, "upstream_wrong"),
    ]
    assert recorded[1]["recheck"] and recorded[1]["rechecked_verdict"] == "wrong"


def test_a_terminated_worker_is_not_restarted_and_its_case_runs_again(fuzz, tmp_path, monkeypatch):
    import signal
    import subprocess

    calls = []

    class Finished:
        returncode = -signal.SIGTERM

    with monkeypatch.context() as patched:
        patched.setattr(subprocess, "run", lambda command: calls.append(command) or Finished())
        fuzz._run_until_done(["--worker", "--families", "dyt"])
    assert len(calls) == 1

    def terminated(family, seed, index, timeout):
        raise SystemExit(143)

    monkeypatch.setattr(fuzz, "run_one", terminated)
    with pytest.raises(SystemExit):
        fuzz.main(["--cases", "4", "--state-dir", str(tmp_path), "--families", "dyt"])
    assert not list(tmp_path.glob("*.inflight")) and not (tmp_path / "dyt-seed0.jsonl").exists()


def test_recheck_stale_runs_again_only_the_cases_drawn_differently_today(
    fuzz, monkeypatch, tmp_path
):
    import dataclasses

    ran = []
    draw = fuzz.draw_case

    def run_one(family, seed, index, timeout):
        ran.append(index)
        return {
            "verdict": "ok",
            "detail": "",
            "index": index,
            "case": repr(draw(family, seed, index)),
        }

    monkeypatch.setattr(fuzz, "run_one", run_one)
    args = ["--cases", "3", "--state-dir", str(tmp_path), "--families", "dyt"]
    assert fuzz.main(args) == 0
    ran.clear()

    def changed_generator(family, seed, index):
        case = draw(family, seed, index)
        return dataclasses.replace(case, alpha=case.alpha + 1) if index == 1 else case

    monkeypatch.setattr(fuzz, "draw_case", changed_generator)
    assert fuzz.main([*args, "--recheck", fuzz.STALE]) == 0
    assert ran == [1]


def test_a_record_that_predates_a_field_with_its_default_is_current(fuzz):
    case = fuzz.draw_case("scalar_mul", 2026, 0)
    assert case.shared_input == "same"
    predating = repr(case).replace(", shared_input='same'", "")
    assert "shared_input" not in predating
    assert not fuzz._draw_changed({"index": 0, "case": predating}, "scalar_mul", 2026)
    moved = predating.replace(f"seed={case.seed},", f"seed={case.seed + 1},")
    assert fuzz._draw_changed({"index": 0, "case": moved}, "scalar_mul", 2026)


def test_sigterm_stops_the_run_even_inside_a_catch_all_and_leaves_no_in_flight_marker(tmp_path):
    """A harness catches broad exceptions (and finalizers swallow them), so stopping must not
    depend on an exception surviving the code the signal interrupts."""
    import subprocess
    import sys

    marker = tmp_path / "dyt-seed0.inflight"
    marker.write_text("3")
    script = f"""
import importlib.util, os, signal, time
spec = importlib.util.spec_from_file_location("tool", {str(TOOL)!r})
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
signal.signal(signal.SIGTERM, tool._on_terminate)
tool._in_flight_marker = tool.Path({str(marker)!r})
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
except BaseException:
    pass
print("went on")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 128 + 15, done.stderr
    assert "went on" not in done.stdout
    assert not marker.exists()


def test_a_case_is_drawn_the_same_in_a_process_that_loaded_other_modules_first():
    """Hypothesis also draws constants found in the source of loaded modules; a case must
    not depend on what the process imported before drawing it."""
    import subprocess
    import sys

    script = f"""
import importlib.util, sys
{{preload}}
spec = importlib.util.spec_from_file_location("tool", {str(TOOL)!r})
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
for index in range(120):
    print(repr(tool.draw_case("scalar_mul", 2026, index)))
"""
    preloads = ["", "import etfold.harness.differential, etfold.backends.arm.registration"]
    drawn = [
        subprocess.run(
            [sys.executable, "-c", script.format(preload=preload)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for preload in preloads
    ]
    assert drawn[0].count("ScalarMulCase") == 120
    assert drawn[0] == drawn[1]


def test_recheck_by_a_case_field_runs_again_the_cases_the_repr_shows_it_in(fuzz):
    record = {
        "index": 0,
        "verdict": "ok",
        "case": "ScalarMulCase(seed=3, share=True, state='none')",
    }
    assert fuzz._to_recheck(record, ["share=True"], "scalar_mul", 0)
    assert fuzz._to_recheck(record, ["state='none'"], "scalar_mul", 0)
    assert not fuzz._to_recheck(record, ["share=False", "wrong"], "scalar_mul", 0)
    assert not fuzz._to_recheck(record, ["seed=30"], "scalar_mul", 0)
