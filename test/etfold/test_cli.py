# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""`etfold report` as a user meets it: one stderr line and a documented exit code for
every bad input, no traceback unless --debug, lazy imports, every decision on --explain."""

import json
import re
import subprocess
import sys

import pytest
import torch
from torch.nn.utils.parametrizations import weight_norm

from etfold import cli, report, report_workers
from etfold.demo_models import catalogue

FAST = ["--budget", "0.05", "--runs", "3", "--no-npu"]


def _run(capfd, argv: list[str]) -> tuple[int, str, list[str]]:
    code = cli.main(argv)
    captured = capfd.readouterr()
    return code, captured.out, captured.err.splitlines()


def _assert_one_clean_line(lines: list[str], *fragments: str) -> None:
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def _save(tmp_path, module, args, kwargs=None, name="program.pt2"):
    path = tmp_path / name
    torch.export.save(torch.export.export(module, args, kwargs), path)
    return path


class WithKeyword(torch.nn.Module):
    def forward(self, x, *, bias):
        return x + bias


class CustomOp(torch.nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        return self.op(torch.relu(x))


def _custom_op_library(namespace: str):
    """A custom op with eager and meta kernels but no out variant (nothing can emit it)."""
    lib = torch.library.Library(namespace, "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
    lib.impl("twice", torch.empty_like, "Meta")
    return lib, getattr(torch.ops, namespace).twice


def test_missing_file(capfd, tmp_path):
    code, out, err = _run(capfd, ["report", "--program", str(tmp_path / "nope.pt2")])
    assert (code, out) == (2, "")
    _assert_one_clean_line(err, "nope.pt2: no such file")


def test_missing_file_with_debug_shows_the_traceback(capfd, tmp_path):
    code, _, err = _run(capfd, ["report", "--program", str(tmp_path / "nope.pt2"), "--debug"])
    assert code == 2
    assert err[0].startswith("Traceback") and err[-1].endswith("nope.pt2: no such file")


def test_text_file(capfd, tmp_path):
    path = tmp_path / "notes.pt2"
    path.write_text("not a program\n")
    code, _, err = _run(capfd, ["report", "--program", str(path)])
    assert code == 2
    _assert_one_clean_line(err, "notes.pt2: not a readable .pt2 archive")


def test_truncated_pt2(capfd, tmp_path):
    path = _save(tmp_path, torch.nn.Linear(4, 2).eval(), (torch.randn(1, 4),))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    code, _, err = _run(capfd, ["report", "--program", str(path)])
    assert code == 2
    _assert_one_clean_line(err, "not a readable .pt2 archive (truncated")


def test_keyword_example_inputs(capfd, tmp_path):
    path = _save(tmp_path, WithKeyword(), (torch.randn(2),), {"bias": torch.randn(2)})
    code, _, err = _run(capfd, ["report", "--program", str(path)])
    assert code == 2
    _assert_one_clean_line(err, "example inputs are passed by keyword (bias)")


def test_pt2_without_example_inputs(capfd, tmp_path):
    program = torch.export.export(torch.nn.Linear(4, 2).eval(), (torch.randn(1, 4),))
    program._example_inputs = None
    path = tmp_path / "bare.pt2"
    torch.export.save(program, path)
    code, _, err = _run(capfd, ["report", "--program", str(path)])
    assert code == 2
    _assert_one_clean_line(err, "saved without example inputs")


def test_unregistered_custom_op(capfd, tmp_path):
    lib, op = _custom_op_library("etfold_cli_gone")
    path = _save(tmp_path, CustomOp(op), (torch.randn(2, 3),))
    lib._destroy()
    code, _, err = _run(capfd, ["report", "--program", str(path)])
    assert code == 2
    _assert_one_clean_line(
        err, "uses torch.ops.etfold_cli_gone.twice.default, which is not registered"
    )


def test_a_program_that_fails_to_lower(capfd, tmp_path):
    lib, op = _custom_op_library("etfold_cli_no_out")
    try:
        path = _save(tmp_path, CustomOp(op), (torch.randn(2, 3),))
        code, out, err = _run(capfd, ["report", "--program", str(path), *FAST])
    finally:
        lib._destroy()
    assert code == 1
    # the progress line is the one stderr line, and it names the op and upstream's message
    _assert_one_clean_line(err, "FAILED (stock and etfold): RuntimeError: Missing out variants")
    assert "etfold_cli_no_out::twice" in err[0]
    assert out.count("FAILED: RuntimeError: Missing out variants") == 2


def test_a_lowering_failure_with_debug_shows_its_traceback(capfd, tmp_path):
    lib, op = _custom_op_library("etfold_cli_no_out_debug")
    try:
        path = _save(tmp_path, CustomOp(op), (torch.randn(2, 3),))
        code, _, err = _run(capfd, ["report", "--program", str(path), "--debug", *FAST])
    finally:
        lib._destroy()
    assert code == 1
    assert any(line.startswith("Traceback") for line in err)
    assert "RuntimeError: Missing out variants: {'etfold_cli_no_out_debug::twice'}" in err


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--runs", "0"], "argument --runs: expected a whole number of at least 1, got '0'"),
        (["--runs", "many"], "argument --runs: expected a whole number"),
        (["--budget", "-1"], "argument --budget: expected a positive number of seconds"),
        (["--backend", "gpu"], "argument --backend: invalid choice: 'gpu'"),
        (["--model", "no_such_model"], "unknown model(s): no_such_model"),
        (["--model", "conv_block", "--program", "x.pt2"], "give --program or --model, not both"),
        (["--all", "--program", "x.pt2"], "give --program or --all, not both"),
        (["--json", "--jsonl"], "give --json or --jsonl, not both"),
        (["--jobs", "0"], "argument --jobs: expected a whole number of at least 1"),
    ],
    ids=[
        "runs-0",
        "runs-text",
        "budget",
        "backend",
        "unknown-model",
        "program-and-model",
        "program-and-all",
        "json-and-jsonl",
        "jobs-0",
    ],
)
def test_bad_arguments(capfd, argv, fragment):
    try:
        code = cli.main(["report", *argv])
    except SystemExit as exit:  # argparse's own errors leave through SystemExit
        code = exit.code
    captured = capfd.readouterr()
    assert (code, captured.out) == (2, "")
    _assert_one_clean_line(captured.err.splitlines(), fragment)


def test_help_and_list_do_not_import_torch():
    probe = (
        "import sys, contextlib, io\n"
        "from etfold import cli\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    cli.main(['--help'])\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert cli.main(['report', '--list']) == 0\n"
        "print(sorted(m for m in ('torch', 'executorch', 'numpy') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_list_json(capfd):
    code, out, err = _run(capfd, ["report", "--list", "--json"])
    assert code == 0 and err == []
    rows = json.loads(out)
    assert {"conv_block", "conv_block_int8"} <= {r["name"] for r in rows}
    fields = {"name", "backend", "description", "default", "missing_extras"}
    assert all(set(r) == fields for r in rows)
    assert 0 < sum(r["default"] for r in rows) < len(rows)


class FiveWeightNormLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(
            *(weight_norm(torch.nn.Linear(16, 16), name="weight", dim=0) for _ in range(5))
        )

    def forward(self, x):
        return self.layers(x)


def test_explain_prints_every_decision_for_a_users_program(capfd, tmp_path):
    torch.manual_seed(0)
    path = _save(tmp_path, FiveWeightNormLayers().eval(), (torch.randn(2, 16),))
    code, out, err = _run(capfd, ["report", "--program", str(path), "--explain", *FAST])
    assert code == 0 and len(err) == 1 and err[0].endswith("ok")
    decisions = out.split("fold decisions:")[1].splitlines()
    ours = [line for line in decisions if "[etfold] applied" in line]
    assert len(ours) >= 5, decisions
    assert len({line.rsplit("(", 1)[1] for line in ours}) == len(ours)  # each with its node
    assert not any("--explain lists all" in line for line in decisions)


def test_rows_stream_to_stdout_as_each_model_finishes():
    """Two workers: the first model's rows are out before the second model has finished
    (stdout and stderr share one pipe, so their order is the order of writes), and the
    rows are the ones a serial run in one process gives."""
    models = ["--model", "pos_conv_small", "--model", "mlp"]
    result = subprocess.run(
        [sys.executable, "-m", "etfold.cli", "report", *models, "--jsonl", "--jobs", "2", *FAST],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout
    lines = result.stdout.splitlines()
    assert lines[0] == "running: pos_conv_small, mlp; 0 of 2 done, 0 waiting"
    done = [i for i, line in enumerate(lines) if line.startswith("[")]
    rows = [i for i, line in enumerate(lines) if line.startswith("{")]
    assert len(done) == 2 and len(rows) == 4, lines
    first = re.fullmatch(r"\[1/2\] (\w+) \(xnnpack\) … \d+\.\d s, ok", lines[done[0]])
    assert first and re.fullmatch(r"\[2/2\] \w+ \(xnnpack\) … \d+\.\d s, ok", lines[done[1]])
    assert [json.loads(lines[i])["model"] for i in rows[:2]] == [first.group(1)] * 2
    assert done[0] < rows[0] < rows[1] < done[1] < rows[2]
    streamed = [json.loads(lines[i]) for i in rows]
    assert {(r["model"], r["flavour"]) for r in streamed} == {
        (m, f) for m in ("pos_conv_small", "mlp") for f in ("stock", "etfold")
    }
    assert all(r["timed_rounds"] >= 3 for r in streamed)
    serial = _serial_rows(["pos_conv_small", "mlp"])
    assert sorted(map(_deterministic, streamed)) == sorted(map(_deterministic, serial))
    assert any(r["applied"] for r in serial if r["flavour"] == "etfold")  # decisions compared too


def _serial_rows(names: list[str]) -> list[dict]:
    """The rows the same models give run one after the other in this process."""
    entries = [e for e in catalogue() if e.name in names and e.backend == "xnnpack"]
    refs = [report_workers.ModelRef.of_entry(entry) for entry in entries]
    options = report_workers.RunOptions(report.TimingPlan(budget_s=0.05, min_rounds=3), npu=False)
    outcomes = []
    report_workers.run_models(
        refs, options, 1, started=lambda ref: None, finished=lambda ref, o, s: outcomes.extend(o)
    )
    return json.loads(json.dumps(report.as_json_rows(outcomes)))


def _deterministic(row: dict) -> str:
    """What a row must hold whichever worker, and in whichever order, made it."""
    fields = ("model", "flavour", "delegates", "ops_outside", "pte_bytes", "applied", "declined")
    return json.dumps([row[f] for f in (*fields, "failure")], sort_keys=True)


def test_json_is_one_array_with_a_row_a_line(capfd, tmp_path):
    path = _save(tmp_path, torch.nn.Linear(4, 2).eval(), (torch.randn(1, 4),))
    code, out, err = _run(capfd, ["report", "--program", str(path), "--json", *FAST])
    assert code == 0 and len(err) == 1
    lines = out.splitlines()
    assert lines[0] == "[" and lines[-1] == "]" and len(lines) == 4
    assert [row["flavour"] for row in json.loads(out)] == ["stock", "etfold"]
    assert lines[1].startswith(" {") and lines[2].startswith(",{")  # each line whole when written
    assert [json.loads(line[1:])["flavour"] for line in lines[1:3]] == ["stock", "etfold"]
