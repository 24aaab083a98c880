# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""`etfold lower` on a user's saved program: the .pte it writes runs and matches eager
(XNNPACK on the wheel's runtime, TOSA INT on the reference model); every bad input is
one stderr line and a non-zero exit, a missing file before torch is imported."""

import argparse
import subprocess
import sys
import zipfile

import pytest
import torch
from torch.nn.utils.parametrizations import weight_norm

from etfold import calibration, cli, lowering

BOUNDED = torch.export.Dim("batch", min=1, max=8)


class WeightNormMlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = weight_norm(torch.nn.Linear(8, 16))
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


class ScaledConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return torch.relu(self.conv(x) * 0.5)


def _save(path, module, inputs, dynamic_shapes=None):
    torch.export.save(torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes), path)
    return str(path)


def _run(capfd, argv):
    try:
        code = cli.main(argv)
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    captured = capfd.readouterr()
    return code, captured.out, captured.err.splitlines()


def _one_line(lines, fragment):
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_xnnpack_pte_loads_on_the_runtime_and_matches_eager(capfd, tmp_path, dynamic):
    from executorch.runtime import Runtime

    torch.manual_seed(0)
    model = WeightNormMlp().eval()
    shapes = ({0: BOUNDED},) if dynamic else None
    path = _save(tmp_path / "mlp.pt2", model, (torch.randn(2, 8),), shapes)
    out = tmp_path / "mlp.pte"
    code, stdout, err = _run(capfd, ["lower", path, "-o", str(out)])
    assert (code, err) == (0, []), err
    assert "1 delegate(s)" in stdout and "ops outside delegates: none" in stdout
    assert "applied  xnnpack.fold_gemm_weight" in stdout
    # the method reads the program (and the bytes it holds): both must outlive its calls
    program = Runtime.get().load_program(out.read_bytes())
    method = program.load_method("forward")
    for batch in (1, 8) if dynamic else (2,):
        x = torch.randn(batch, 8)
        (actual,) = method.execute((x,))
        with torch.no_grad():
            torch.testing.assert_close(actual, model(x), atol=1e-5, rtol=1e-5)


def _tosa_payloads(buffer: bytes) -> list[bytes]:
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(buffer).program
    (plan,) = program.execution_plan
    return [program.backend_delegate_data[d.processed.index].data for d in plan.delegates]


def test_tosa_int_pte_holds_the_graph_that_matches_eager_on_the_reference_model(
    capfd, tmp_path, monkeypatch
):
    from etfold.harness import tosa_runner

    torch.manual_seed(0)
    model = ScaledConv().eval()
    inputs = (torch.randn(1, 3, 8, 8),)
    path = _save(tmp_path / "conv.pt2", model, inputs)
    samples = [(torch.randn(1, 3, 8, 8),) for _ in range(8)]
    torch.save(samples, tmp_path / "samples.pt")
    lowered = []  # the CLI's own lowering, kept to run its graph on the reference model

    def keep(*args, **kwargs):
        lowered.append(lower_program(*args, **kwargs))
        return lowered[-1]

    lower_program = lowering.lower_program
    monkeypatch.setattr(lowering, "lower_program", keep)
    out = tmp_path / "conv.pte"
    argv = ["lower", path, "--backend", "tosa-int", "--calibration", str(tmp_path / "samples.pt")]
    code, stdout, err = _run(capfd, [*argv, "-o", str(out), "--explain"])
    assert (code, err) == (0, []), err
    assert "applied  arm.scalar_mul_into_conv" in stdout
    (program,) = lowered
    assert _tosa_payloads(out.read_bytes()) == program.program.tosa_graphs
    assert program.program.operator_counts()["MUL"] == 0
    (scale,) = tosa_runner.output_scales(program.program)
    for x in (inputs[0], samples[3][0]):
        (actual,) = program.program.run(x).outputs
        with torch.no_grad():
            expected = model(x)
        assert float((actual - expected).abs().max()) <= 2 * scale


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["lower", "{tmp}/nope.pt2", "-o", "{tmp}/x.pte"], "nope.pt2: no such file"),
        (["lower", "{tmp}", "-o", "{tmp}/x.pte"], "is a directory, expected a .pt2 file"),
        (["lower", "{tmp}/notes.txt", "-o", "{tmp}/x.pte"], "not a readable .pt2 archive"),
        (["lower", "{tmp}/zip.pt2", "-o", "{tmp}/no/dir/x.pte"], "cannot write there"),
        (["report", "--program", "{tmp}/nope.pt2"], "nope.pt2: no such file"),
        (
            ["report", "--program", "{tmp}/zip.pt2", "--backend", "arm", "--calibration", "c"],
            "c: no such file",
        ),
    ],
    ids=["missing", "directory", "not-a-pt2", "no-output-folder", "report-missing", "no-samples"],
)
def test_a_bad_file_is_one_line_before_torch_is_imported(tmp_path, argv, fragment):
    (tmp_path / "notes.txt").write_text("not a program\n")
    with zipfile.ZipFile(tmp_path / "zip.pt2", "w") as archive:  # passes the archive check
        archive.writestr("archive/version", "0")
    argv = [a.format(tmp=tmp_path) for a in argv]
    probe = (
        "import sys\n"
        "from etfold import cli\n"
        f"code = cli.main({argv!r})\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.stdout.split() == ["2", "False"], (result.stdout, result.stderr)
    _one_line(result.stderr.splitlines(), fragment)


def test_version_and_help_import_no_torch():
    probe = (
        "import sys, contextlib, io\n"
        "from etfold import cli\n"
        "for argv in (['--version'], ['lower', '--help']):\n"
        "    with contextlib.suppress(SystemExit):\n"
        "        cli.main(argv)\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "etfold 0.1.0 (supports executorch 1.5.1 with torch 2.13.x)"
    assert "--calibration FILE" in result.stdout and lines[-1] == "False"


def test_list_shows_only_the_models_of_the_backend_asked_for(capfd):
    for backend in ("arm", "xnnpack"):
        code, stdout, _ = _run(capfd, ["report", "--list", "--backend", backend])
        rows = [line.split() for line in stdout.splitlines()]
        assert code == 0 and rows
        assert {row[1] for row in rows} == {backend}


@pytest.mark.parametrize(
    "samples, fragment",
    [
        ([(torch.randn(1, 3, 9, 9),)], "sample 0 is ((1, 3, 9, 9) torch.float32)"),
        ([(torch.randn(1, 3, 8, 8, dtype=torch.float64),)], "sample 0 is"),
        ([(torch.randn(1, 3, 8, 8), torch.randn(1))], "the program takes ((1, 3, 8, 8)"),
        ([], "expected a non-empty list of input tuples"),
        ({"x": torch.randn(1)}, "expected a non-empty list of input tuples"),
        ([("text",)], "sample 0 is not a tuple of tensors"),
    ],
    ids=["size", "dtype", "count", "empty", "dict", "not-tensors"],
)
def test_calibration_that_does_not_fit_is_one_line(capfd, tmp_path, samples, fragment):
    path = _save(tmp_path / "conv.pt2", ScaledConv().eval(), (torch.randn(1, 3, 8, 8),))
    torch.save(samples, tmp_path / "samples.pt")
    argv = ["lower", path, "--backend", "tosa-int", "-o", str(tmp_path / "x.pte")]
    code, stdout, err = _run(capfd, [*argv, "--calibration", str(tmp_path / "samples.pt")])
    assert (code, stdout) == (2, "")
    _one_line(err, fragment)


def test_calibration_sizes_may_vary_where_the_program_is_dynamic(tmp_path):
    program = torch.export.export(
        WeightNormMlp().eval(), (torch.randn(2, 8),), dynamic_shapes=({0: BOUNDED},)
    )
    assert calibration.input_shapes(program) == [(None, 8)]
    samples = [(torch.randn(5, 8),), torch.randn(1, 8)]
    checked = calibration.check_calibration(samples, (torch.randn(2, 8),), "s", [(None, 8)])
    assert [s[0].shape for s in checked] == [(5, 8), (1, 8)]
    with pytest.raises(calibration.UserInputError, match="sample 0 is"):
        calibration.check_calibration(
            [(torch.randn(5, 9),)], (torch.randn(2, 8),), "s", [(None, 8)]
        )


def test_random_calibration_is_seeded_shaped_like_the_inputs_and_warned_about(capfd):
    example = (torch.randn(2, 3, dtype=torch.bfloat16), torch.tensor([1, 2]))
    first = calibration.random_calibration(example, 3)
    again = calibration.random_calibration(example, 3)
    assert len(first) == 3
    for (x, ids), (x_again, _) in zip(first, again, strict=True):
        assert x.shape == (2, 3) and x.dtype == torch.bfloat16 and torch.equal(x, x_again)
        assert torch.equal(ids, example[1])
    assert not torch.equal(first[0][0], first[1][0])
    args = argparse.Namespace(calibration=None, random_calibration=4)
    source = cli._calibration_source(args, quantized=True, progress=sys.stderr)
    assert source == calibration.CalibrationSource(random_count=4)
    _one_line(capfd.readouterr().err.splitlines(), "calibrating on 4 random inputs")
    assert cli._calibration_source(args, quantized=False, progress=sys.stderr) is None


def test_report_program_on_arm_calibrates_on_the_samples_given(tmp_path):
    from etfold import report

    path = _save(tmp_path / "conv.pt2", ScaledConv().eval(), (torch.randn(1, 3, 8, 8),))
    samples = [(torch.randn(1, 3, 8, 8),) for _ in range(3)]
    torch.save(samples, tmp_path / "samples.pt")
    source = calibration.CalibrationSource(path=str(tmp_path / "samples.pt"))
    model = report.user_program(path, "arm", source)
    given = model.calibration()
    assert len(given) == 3 and all(
        torch.equal(a[0], b[0]) for a, b in zip(given, samples, strict=True)
    )
    assert report.user_program(path, "arm").calibration() == []


def test_a_lowering_that_fails_is_one_line_and_exit_1(capfd, tmp_path):
    lib = torch.library.Library("etfold_lower_no_out", "DEF")
    try:
        lib.define("twice(Tensor x) -> Tensor")
        lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
        lib.impl("twice", torch.empty_like, "Meta")
        op = torch.ops.etfold_lower_no_out.twice

        class UsesOp(torch.nn.Module):
            def forward(self, x):
                return op(torch.relu(x))

        path = _save(tmp_path / "op.pt2", UsesOp(), (torch.randn(2, 3),))
        out = tmp_path / "op.pte"
        code, stdout, err = _run(capfd, ["lower", path, "-o", str(out)])
    finally:
        lib._destroy()
    assert (code, stdout) == (1, "") and not out.exists()
    _one_line(err, "lowering failed: RuntimeError: Missing out variants")
