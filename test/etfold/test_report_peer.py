# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""`etfold report --peer ort`: the user's program run by ONNX Runtime beside stock and etfold,
and etfold without onnxruntime."""

import functools
import json
import subprocess
import sys

import pytest
import torch

from etfold import cli, report
from etfold.harness import onnx_peer, op_profiles

FAST = ["--budget", "0.05", "--runs", "3", "--jobs", "1"]
GEMM = "GEMM: matmul, linear, conv"


def _tiny_program(tmp_path):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()).eval()
    path = tmp_path / "user.pt2"
    torch.export.save(torch.export.export(module, (torch.randn(2, 8),)), path)
    return path


def _report(capfd, *argv: str) -> tuple[int, str, list[str]]:
    code = cli.main(["report", *argv])
    captured = capfd.readouterr()
    return code, captured.out, captured.err.splitlines()


def test_a_saved_program_runs_on_ort_beside_stock_and_etfold(capfd, tmp_path):
    path = str(_tiny_program(tmp_path))
    code, out, _ = _report(capfd, "--program", path, "--peer", "ort", "--json", *FAST)
    assert code == 0
    rows = json.loads(out)
    assert [r["flavour"] for r in rows] == ["stock", "etfold", "ort"]
    stock, ours, ort = rows
    assert ort["failure"] is None and ort["max_error"] < 1e-5
    assert ort["timed_rounds"] == ours["timed_rounds"] >= 3  # one interleaved timing
    assert ort["ratio_p10"] <= ort["ratio"] <= ort["ratio_p90"]  # ORT/stock
    assert ort["vs_etfold_p10"] <= ort["vs_etfold"] <= ort["vs_etfold_p90"]
    assert ort["delegates"] == 0 and ort["pte_bytes"] == 0  # no ExecuTorch program
    assert stock["vs_etfold"] is None and ours["vs_etfold"] is None


def test_an_ort_export_failure_is_ort_s_row_and_not_a_failed_report(capfd, tmp_path, monkeypatch):
    def exporter_fails(*args, **kwargs):
        raise RuntimeError("no ONNX function for this op\nsecond line")

    monkeypatch.setattr(torch.onnx, "export", exporter_fails)
    path = str(_tiny_program(tmp_path))
    code, out, err = _report(capfd, "--program", path, "--peer", "ort", *FAST)
    assert code == 0  # stock and etfold both lowered and ran
    ort_rows = [line for line in out.splitlines() if " ort " in line]
    others = [line for line in out.splitlines() if " ort " not in line]
    assert len(ort_rows) == 1
    assert "FAILED: ORT export: RuntimeError: no ONNX function for this op" in ort_rows[0]
    assert not any("FAILED" in line for line in others)
    assert "FAILED (ort): ORT export" in err[-1]


def test_without_onnxruntime_one_line_says_how_to_get_it(capfd, tmp_path, monkeypatch):
    path = str(_tiny_program(tmp_path))
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` now fails
    code, out, err = _report(capfd, "--program", path, "--peer", "ort")
    assert (code, out) == (cli.EXIT_USAGE, "")
    assert err == ["etfold: error: --peer ort needs onnxruntime: pip install 'etfold[peers]'"]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--peer", "tvm"], "argument --peer: invalid choice: 'tvm'"),
        (["--peer", "ort", "--backend", "arm"], "--peer times CPU runtimes beside XNNPACK rows"),
    ],
    ids=["unknown-peer", "arm-backend"],
)
def test_a_bad_peer_is_one_line(capfd, argv, fragment):
    try:
        code = cli.main(["report", *argv])
    except SystemExit as exit:  # argparse's own errors leave through SystemExit
        code = exit.code
    captured = capfd.readouterr()
    assert (code, captured.out) == (cli.EXIT_USAGE, "")
    (line,) = captured.err.splitlines()
    assert fragment in line and "Traceback" not in line


_BLOCKED = (
    "import sys\n"
    "for name in ('onnxruntime', 'onnx', 'onnxscript'):\n"
    "    sys.modules[name] = None  # unimportable, as where the extra is not installed\n"
)


def test_etfold_imports_and_report_help_works_without_onnxruntime():
    probe = _BLOCKED + (
        "import contextlib, io\n"
        "import etfold, etfold.report, etfold.report_workers, etfold.harness.onnx_peer\n"
        "from etfold import cli\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    cli.main(['report', '--help'])\n"
        "assert '--peer' in out.getvalue(), out.getvalue()\n"
        "print(etfold.harness.onnx_peer.missing_modules())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "('onnxruntime', 'onnx', 'onnxscript')"


def test_importing_etfold_does_not_import_onnxruntime():
    probe = (
        "import sys\n"
        "import etfold, etfold.report, etfold.cli, etfold.harness.onnx_peer\n"
        "print(sorted(m for m in ('onnxruntime', 'onnx', 'onnxscript') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_table_with_a_peer_shows_its_ratios_to_stock_and_to_etfold():
    stock = report.Outcome("m", "xnnpack", "stock", 1, {}, 100, 2.0, 0.0, timed_rounds=5)
    ours = report.Outcome("m", "xnnpack", "etfold", 1, {}, 90, 1.0, 0.0, timed_rounds=5)
    ours.ratio = ours.ratio_p10 = ours.ratio_p90 = 0.5
    ort = report.Outcome("m", "xnnpack", "ort", median_ms=1.5, max_error=1e-7, timed_rounds=5)
    ort.p10_ms, ort.p90_ms = 1.25, 1.75
    ort.ratio, ort.ratio_p10, ort.ratio_p90 = 0.75, 0.7, 0.8
    ort.vs_etfold, ort.vs_etfold_p10, ort.vs_etfold_p90 = 1.5, 1.4, 1.6
    lines = report.format_table([stock, ours, ort]).splitlines()
    assert "row/stock (p10–p90)" in lines[1] and "row/etfold (p10–p90)" in lines[1]
    assert lines[-1].split() == [
        *("m", "ort", "-", "-", "-", "1.500", "(1.250–1.750)"),
        *("0.75x", "(0.70–0.80)", "1.50x", "(1.40–1.60)", "-", "1e-07", "-"),
    ]
    streamed = report.TableStream(1, peers=True).add([stock, ours, ort])
    assert streamed[1].split()[:8] == lines[1].split()[:8]
    plain = report.format_table([stock, ours]).splitlines()
    assert "etfold/stock (p10–p90)" in plain[1] and "row/etfold" not in plain[1]


def _events(runs: list[tuple[int, int]], kernels: list[tuple[int, str, int]]) -> list[dict]:
    """ORT profile events: model runs (start, duration) and kernels (start, op type, duration)."""
    events = [{"cat": "Session", "name": "model_run", "ts": t, "dur": d} for t, d in runs]
    for index, (t, op, d) in enumerate(kernels):
        events.append(
            {"cat": "Node", "name": f"n{index % 2}_kernel_time", "ts": t, "dur": d}
            | {"args": {"op_name": op}}
        )
    return events


def test_ort_profile_keeps_runs_after_warm_up_and_each_node_s_typical_time():
    runs = [(0, 100), (100, 100), (200, 100), (300, 100)]
    kernels = [  # (start, op, microseconds)
        (10, "MatMul", 90),  # the warm-up run: left out
        (11, "Add", 90),
        (110, "MatMul", 40),
        (111, "Add", 5),
        (210, "MatMul", 42),
        (211, "Add", 500),  # preempted once: the slowest tenth is left out
        (310, "MatMul", 44),
        (311, "Add", 7),
    ]
    profile = onnx_peer.profile_from_events(_events(runs, kernels), skip_runs=1)
    assert profile.runs == 3 and profile.calls == 2 and profile.total_ms == pytest.approx(0.1)
    assert profile.by_op == pytest.approx({"MatMul": 0.041, "Add": 0.006})


def test_typical_time_keeps_sub_tick_ops_and_drops_the_slowest_tenth():
    ticks = [0.0] * 14 + [0.001] * 6  # an op of 0.3 us read in whole microseconds
    assert onnx_peer.typical(ticks) == pytest.approx(0.004 / 18)
    assert onnx_peer.typical([1.0] * 9 + [50.0]) == 1.0
    assert onnx_peer.typical([2.0]) == 2.0


def test_gaps_compare_kinds_of_work_across_the_two_runtimes():
    ours = onnx_peer.OpProfile(
        {
            "Fully Connected (NC, F32) GEMM": 1.0,
            "Batch Matrix Multiply (NC, F32)": 0.5,
            "Transpose (ND, X32)": 0.4,
            "native_call_where.self_out": 0.3,
        },
        2.5,
        20,
    )
    ours = op_profiles.with_runtime_overhead(ours, 2.4)
    theirs = op_profiles.with_runtime_overhead(
        onnx_peer.OpProfile({"MatMul": 1.2, "Transpose": 0.1}, 1.4, 20), 1.4
    )
    gaps = {g.kind: g for g in op_profiles.gaps_by_kind(ours, theirs)}
    assert gaps[GEMM].gap_ms == pytest.approx(0.3)
    assert not gaps[GEMM].by_rewrite  # the same GEMMs: the kernels'
    assert gaps["layout / copies"].gap_ms == pytest.approx(0.3)
    assert gaps[op_profiles.OUTSIDE].by_rewrite and gaps[op_profiles.OUTSIDE].ort_ms == 0
    assert gaps[op_profiles.RUNTIME_OVERHEAD].executorch_ms == pytest.approx(0.2)
    assert gaps[op_profiles.RUNTIME_OVERHEAD].ort_ms == pytest.approx(0.1)
    assert op_profiles.executorch_kind("Convolution (NHWC, F32) IGEMM") == GEMM
    assert op_profiles.ort_kind("Conv") == GEMM  # XNNPACK runs a 1x1 conv as fully connected
    assert op_profiles.executorch_kind("Multiply (ND, F32)") == "elementwise / activations"
    first = op_profiles.gap_lines(ours, theirs)[0]
    assert first.startswith(GEMM) or first.startswith("layout / copies")


@functools.cache
def _linear_on_both_runtimes():
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    from etfold.harness.xnnpack_runner import lower_xnnpack

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()).eval()
    inputs = (torch.randn(1, 4, 16),)
    ours = lower_xnnpack(torch.export.export(module, inputs), [XnnpackPartitioner()])
    theirs = onnx_peer.export_to_ort(torch.export.export(module, inputs))
    return ours, theirs, inputs


@pytest.mark.long  # a second ORT export; the report test above runs ORT in make test
def test_both_profilers_see_the_gemm_of_a_linear():
    ours, theirs, inputs = _linear_on_both_runtimes()
    executorch = op_profiles.etdump_op_profile(ours.executorch.buffer, inputs, runs=3, warmup=1)
    ort = onnx_peer.ort_op_profile(theirs, inputs, runs=3, warmup=1)
    assert {op_profiles.executorch_kind(op) for op in executorch.by_op} == {GEMM}
    assert GEMM in {op_profiles.ort_kind(op) for op in ort.by_op}
    assert executorch.total_ms > 0 and ort.total_ms > 0
