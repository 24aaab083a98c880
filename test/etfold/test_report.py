# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""`etfold report` lowers with stock and with etfold and runs both on the real runtime."""

import io
import json
import re

import torch
from hypothesis import given
from hypothesis import strategies as st

from etfold import cli, demo_models, report, report_workers
from etfold.demo_models import all_models


def test_every_built_in_model_has_a_unique_name_and_a_known_backend():
    models = all_models()
    assert len({m.name for m in models}) == len(models)
    assert {m.backend for m in models} <= {"xnnpack", "arm"}
    assert sum(m.backend == "xnnpack" for m in models) >= 3
    assert sum(m.backend == "arm" for m in models) >= 1


def test_catalogue_read_from_source_matches_the_imported_models():
    imported = [(m.name, m.backend, m.description, tuple(m.requires)) for m in all_models()]
    read = [(e.name, e.backend, e.description, e.requires) for e in demo_models.catalogue()]
    assert read == imported
    assert ("transformers",) in {e.requires for e in demo_models.catalogue()}


def test_a_model_with_a_missing_extra_is_skipped_with_one_line_naming_it(monkeypatch, capsys):
    monkeypatch.setitem(demo_models.BACKEND_REQUIRES, "arm", ("etfold_no_such_module",))
    monkeypatch.setitem(demo_models.EXTRA_FOR_MODULE, "etfold_no_such_module", "arm")
    assert cli.main(["report", "--backend", "arm", "--all", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == []
    arm = [e.name for e in demo_models.catalogue() if e.backend == "arm"]
    assert captured.err == f"skipped {', '.join(arm)}: pip install 'etfold[arm]' to run them\n"


def test_report_runs_both_lowerings_on_the_runtime(capsys):
    argv = [
        "report",
        "--model",
        "conv_block",
        "--model",
        "conv_block_int8",
        "--json",
        "--jobs",
        "1",
    ]
    assert cli.main([*argv, "--runs", "20", "--budget", "0.05", "--no-npu"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["model"], r["flavour"]) for r in rows] == [
        ("conv_block", "stock"),
        ("conv_block", "etfold"),
        ("conv_block_int8", "stock"),
        ("conv_block_int8", "etfold"),
    ]
    for row in rows:
        assert row["failure"] is None
        assert row["delegates"] == 1 and row["pte_bytes"] > 0
    stock, ours, arm_stock, arm_ours = rows
    assert stock["pte_bytes"] == ours["pte_bytes"]  # nothing to fold: the same program
    for row in (stock, ours):
        assert row["timed_rounds"] >= 20
        assert 0 < row["p10_ms"] <= row["median_ms"] <= row["p90_ms"]
    assert ours["ratio_p10"] <= ours["ratio"] <= ours["ratio_p90"] and stock["ratio"] is None
    assert stock["max_error"] < 1e-4
    # Arm rows: TOSA operators, no reference-model wall time
    for row in (arm_stock, arm_ours):
        assert row["median_ms"] is None and row["timed_rounds"] == 0
        assert row["tosa_ops"]["CONV2D"] == 2
        assert row["max_error"] < 0.05  # int8: a couple of LSB of the output scale
    assert arm_stock["tosa_ops"] == arm_ours["tosa_ops"]


def test_table_lists_every_row_and_decision():
    outcomes = [
        report.Outcome("m", "xnnpack", "stock", 2, {"aten.add.Tensor": 1}, 100, 1.0, 0.0),
        report.Outcome(
            "m",
            "xnnpack",
            "etfold",
            1,
            {},
            90,
            0.5,
            0.0,
            applied=[{"fold": "fold.x", "where": "n", "detail": "ok"}],
            declined=[{"fold": "fold.y", "where": f"k{i}", "detail": "why"} for i in range(3)],
        ),
        report.Outcome("n", "arm", "stock", failure="RuntimeError: boom"),
    ]
    table = report.format_table(outcomes)
    assert "declined fold.y ×3: why (e.g. k0)" in table
    assert "applied  fold.x: ok (n)" in table
    assert "FAILED: RuntimeError: boom" in table
    many = report.Outcome("w", "xnnpack", "etfold")
    many.applied = [{"fold": "fold.z", "where": f"n{i}", "detail": f"site {i}"} for i in range(5)]
    lines = report.format_table([many]).splitlines()
    assert sum("applied  fold.z: site" in line for line in lines) == 3
    assert any("fold.z: 2 more (--explain lists all)" in line for line in lines)
    explained = report.format_table([many], explain=True).splitlines()
    assert sum("applied  fold.z: site" in line for line in explained) == 5
    # a title and two header lines per backend, a blank line between, then the decisions
    assert len(table.splitlines()) == (3 + 2) + 1 + (3 + 1) + 2 + 2


def test_report_accepts_a_users_exported_program(tmp_path, capsys):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()).eval()
    path = tmp_path / "user.pt2"
    torch.export.save(torch.export.export(module, (torch.randn(2, 8),)), path)
    assert cli.main(["report", "--program", str(path), "--budget", "0.05", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["flavour"] for r in rows] == ["stock", "etfold"]
    assert all(r["max_error"] < 1e-5 and r["delegates"] == 1 for r in rows)


def test_unknown_model_is_a_clear_error(capsys):
    assert cli.main(["report", "--model", "no_such_model"]) == 2
    assert "unknown model(s): no_such_model" in capsys.readouterr().err


def test_interleaved_timing_rotates_instances_and_pairs_every_round():
    from collections import Counter

    from etfold.harness.timing import time_interleaved

    calls = Counter()

    def instance(name):
        return lambda: calls.update([name])

    timing = time_interleaved(
        {"a": [instance("a0"), instance("a1")], "b": instance("b")},
        budget_s=0.0,
        min_rounds=6,
        warmup=1,
        sample_s=0.0,  # one call per round
    )
    assert timing.rounds == 6 and timing.inner == 1
    # warm-up touches every instance, then rounds alternate a0, a1; b runs every round
    # (the call-count estimate for `inner` runs each name's first instance five times)
    assert calls == {"a0": 1 + 5 + 3, "a1": 1 + 3, "b": 1 + 5 + 6}
    assert set(timing.ratios) == {("a", "b")} and timing.ratios["a", "b"].samples == 6
    for spread in (*timing.milliseconds.values(), *timing.ratios.values()):
        assert spread.p10 <= spread.median <= spread.p90


def test_call_order_gives_every_callable_every_place_with_one_call_per_round():
    from etfold.harness.timing import time_interleaved

    order = []
    time_interleaved(
        {name: (lambda n=name: order.append(n)) for name in "abc"},
        budget_s=0.0,
        min_rounds=6,
        warmup=0,
        sample_s=0.0,
    )
    timed = [tuple(order[i : i + 3]) for i in range(15, len(order), 3)]  # after the estimate
    assert len(set(timed)) == 6  # every order of three, once each


@given(st.integers(1, 6), st.integers(0, 50))
def test_call_order_puts_each_name_in_each_place_twice_over_two_passes(n, start):
    from collections import Counter

    from etfold.harness.timing import call_order

    names = [f"n{i}" for i in range(n)]
    orders = [call_order(names, turn) for turn in range(start, start + 2 * n)]
    assert all(sorted(order) == names for order in orders)
    places = Counter((place, name) for order in orders for place, name in enumerate(order))
    assert set(places.values()) == {2} and len(places) == n * n


def test_stock_row_counts_upstreams_own_fold_and_the_decline_is_explained():
    (cell,) = demo_models.load(
        [e for e in demo_models.catalogue() if e.name == "recurrent_conv_cell_int8"]
    )
    stock, ours = report.evaluate(cell, npu=False)
    assert stock.failure is None and ours.failure is None
    # upstream's unguarded fold folded conv * 0.25 into the conv feeding the state
    assert [(r["fold"], r["where"]) for r in stock.applied] == [("arm.scalar_mul_into_conv", "mul")]
    assert ours.applied == [] and [r["fold"] for r in ours.declined] == ["arm.scalar_mul_into_conv"]
    assert ours.tosa_ops.get("MUL", 0) == stock.tosa_ops.get("MUL", 0) + 1
    assert ours.pte_bytes > stock.pte_bytes
    (note,) = ours.notes
    assert "where etfold declined 1×" in note and f"{ours.pte_bytes - stock.pte_bytes:+,} B" in note
    table = report.format_table([stock, ours])
    assert f"recurrent_conv_cell_int8 [etfold] note     {note}" in table


# the default run: one model per fold family and backend
DEFAULT_BY_FAMILY = {
    "parameter-only weight subgraphs (XNNPACK)": "pos_conv_small",
    "fp16/bf16 converts (XNNPACK)": "decoder_block_autocast_bf16",
    "scalar mul after conv, carried state (Arm)": "recurrent_conv_cell_int8",
    "DyT (Arm)": "dyt_convnext_block",
}


def _selected(monkeypatch, capsys, *argv: str) -> list[str]:
    """The models a run selects, read from the skip lines when no backend can run."""
    for backend in ("xnnpack", "arm"):
        monkeypatch.setitem(demo_models.BACKEND_REQUIRES, backend, ("etfold_no_such_module",))
    monkeypatch.setitem(demo_models.EXTRA_FOR_MODULE, "etfold_no_such_module", "none")
    assert cli.main(["report", "--json", *argv]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == []
    lines = captured.err.splitlines()
    assert all(line.startswith("skipped ") for line in lines), lines
    return [name for line in lines for name in line[len("skipped ") :].split(":")[0].split(", ")]


def test_all_selects_every_model_and_the_default_one_per_fold_family(monkeypatch, capsys):
    every = [e.name for e in demo_models.catalogue()]
    assert sorted(_selected(monkeypatch, capsys, "--all")) == sorted(every)
    default = _selected(monkeypatch, capsys)
    assert set(default) < set(every)
    assert sorted(default) == sorted(DEFAULT_BY_FAMILY.values())
    arm = _selected(monkeypatch, capsys, "--backend", "arm")
    assert sorted(arm) == ["dyt_convnext_block", "recurrent_conv_cell_int8"]
    assert _selected(monkeypatch, capsys, "--model", "mlp") == ["mlp"]
    listed = {e.name for e in demo_models.catalogue() if e.default}
    assert listed == set(default)


def test_model_and_all_together_is_a_usage_error(capsys):
    assert cli.main(["report", "--model", "mlp", "--all"]) == 2
    assert "give --model or --all, not both" in capsys.readouterr().err


def test_timing_gate_lets_a_timed_phase_run_only_while_no_other_worker_works():
    import threading

    gate = report_workers.TimingGate(threading, 2)
    a_working, a_may_leave, b_alone, b_may_leave, a_back = (threading.Event() for _ in range(5))

    def worker_a():
        with gate.working():
            a_working.set()
            a_may_leave.wait()
            gate.between()  # hands over to b's timed phase, and waits for it
            a_back.set()

    def worker_b():
        a_working.wait()
        with gate.working(), gate.alone():
            b_alone.set()
            b_may_leave.wait()

    threads = [threading.Thread(target=worker_a), threading.Thread(target=worker_b)]
    for thread in threads:
        thread.start()
    assert a_working.wait(10)
    assert not b_alone.wait(0.2)  # b waits for a's step to end
    a_may_leave.set()
    assert b_alone.wait(10)
    assert not a_back.wait(0.2)  # a's next step waits for b's timed phase
    b_may_leave.set()
    assert a_back.wait(10)
    for thread in threads:
        thread.join(10)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _finish(progress, name, backend="xnnpack", failure=None):
    ref = report_workers.ModelRef(name, backend)
    rows = [report.Outcome(name, backend, f, failure=failure) for f in report.FLAVOURS]
    progress.finished(ref, rows, 1.25)


def test_progress_lines_in_a_log():
    log = io.StringIO()
    progress = cli._Progress(log, 3)
    for name in ("a", "b"):
        progress.started(report_workers.ModelRef(name, "xnnpack"))
    progress.tick()
    progress.tick()  # nothing changed: nothing printed
    _finish(progress, "b", failure="RuntimeError: boom")
    progress.started(report_workers.ModelRef("c", "arm"))
    progress.tick()
    _finish(progress, "a")
    progress.tick()
    _finish(progress, "c", "arm")
    assert log.getvalue().splitlines() == [
        "running: a, b; 0 of 3 done, 1 waiting",
        "[1/3] b (xnnpack) … 1.2 s, FAILED (stock and etfold): RuntimeError: boom",
        "running: a, c; 1 of 3 done, 0 waiting",
        "[2/3] a (xnnpack) … 1.2 s, ok",
        "running: c; 2 of 3 done, 0 waiting",
        "[3/3] c (arm) … 1.2 s, ok",
    ]


def test_progress_of_one_model_in_a_log_is_its_line_alone():
    log = io.StringIO()
    progress = cli._Progress(log, 1)
    progress.started(report_workers.ModelRef("conv_block", "xnnpack"))
    progress.tick()
    _finish(progress, "conv_block")
    assert log.getvalue() == "[1/1] conv_block (xnnpack) … 1.2 s, ok\n"


def test_progress_on_a_terminal_rewrites_one_status_line():
    terminal = _Terminal()
    progress = cli._Progress(terminal, 2)
    for name in ("a", "b"):
        progress.started(report_workers.ModelRef(name, "xnnpack"))
    progress.tick()
    _finish(progress, "a")
    progress.tick()
    progress.clear()
    erase = "\r\x1b[K"
    status = re.escape(erase) + r"running: {} ; {} of 2 done, 0 waiting"
    pattern = (
        status.format(r"a \(\d+ s\), b \(\d+ s\)", 0)
        + re.escape(erase + "[1/2] a (xnnpack) … 1.2 s, ok\n")
        + status.format(r"b \(\d+ s\)", 1)
        + re.escape(erase)
    ).replace(" ;", ";")
    assert re.fullmatch(pattern, terminal.getvalue()), repr(terminal.getvalue())
