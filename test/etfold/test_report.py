"""`etfold report` lowers with stock and with etfold and runs both on the real runtime."""

import json

import torch

from etfold import cli, report
from etfold.demo_models import all_models


def test_every_built_in_model_has_a_unique_name_and_a_known_backend():
    models = all_models()
    assert len({m.name for m in models}) == len(models)
    assert {m.backend for m in models} <= {"xnnpack", "arm"}
    assert sum(m.backend == "xnnpack" for m in models) >= 3
    assert sum(m.backend == "arm" for m in models) >= 1


def test_report_runs_both_lowerings_on_the_runtime(capsys):
    assert (
        cli.main(
            [
                "report",
                "--model",
                "conv_block",
                "--model",
                "conv_block_int8",
                "--runs",
                "1",
                "--json",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert [(r["model"], r["flavour"]) for r in rows] == [
        ("conv_block", "stock"),
        ("conv_block", "etfold"),
        ("conv_block_int8", "stock"),
        ("conv_block_int8", "etfold"),
    ]
    for row in rows:
        assert row["failure"] is None
        assert row["delegates"] == 1 and row["pte_bytes"] > 0 and row["median_ms"] > 0
    assert rows[0]["max_error"] < 1e-4
    assert rows[2]["max_error"] < 0.05  # int8: a couple of LSB of the output scale


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
    assert any("fold.z: 2 more (--json lists all)" in line for line in lines)
    assert len(table.splitlines()) == 2 + 3 + 2 + 2


def test_report_accepts_a_users_exported_program(tmp_path, capsys):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()).eval()
    path = tmp_path / "user.pt2"
    torch.export.save(torch.export.export(module, (torch.randn(2, 8),)), path)
    assert cli.main(["report", "--program", str(path), "--runs", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["flavour"] for r in rows] == ["stock", "etfold"]
    assert all(r["max_error"] < 1e-5 and r["delegates"] == 1 for r in rows)


def test_unknown_model_is_a_clear_error(capsys):
    assert cli.main(["report", "--model", "no_such_model"]) == 2
    assert "unknown model(s): no_such_model" in capsys.readouterr().err
