# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The built wheel, installed non-editable into a fresh venv with the constraints, runs
`etfold report` from outside the checkout. Installed without extras (an XNNPACK-only
user): the XNNPACK rows run, models needing `arm` or `report` are skipped by name.

Wheels pip downloads are kept in a wheelhouse ($ETFOLD_WHEELHOUSE, default
~/.cache/etfold/wheelhouse) so later runs install offline; pip's own HTTP cache
is not relied on.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
LOCAL_WHEELS = Path("/opt/wheels")  # this machine's CPU torch
SOURCES = ("pyproject.toml", "setup.py", "README.md", "etfold", "backends", "exir")
WHEELHOUSE = Path(
    os.environ.get("ETFOLD_WHEELHOUSE", Path.home() / ".cache" / "etfold" / "wheelhouse")
)


def _check(command: list, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=1200, **kwargs)
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def _build_wheel(tmp_path: Path) -> Path:
    """From a clean copy of the sources, so no stale build/ of the checkout leaks in."""
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
            shutil.copytree(path, source / name, ignore=ignore)
        else:
            shutil.copy2(path, source / name)
    out = tmp_path / "dist"
    _check(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        + ["--quiet", "-w", str(out), str(source)]
    )
    (wheel,) = out.glob("etfold-*.whl")
    return wheel


def _install(python: Path, wheel: Path) -> None:
    links = [f"--find-links={d}" for d in (WHEELHOUSE, LOCAL_WHEELS) if d.is_dir()]
    offline = [str(python), "-m", "pip", "install", "--quiet", "--no-compile", "--no-index"]
    command = offline + links + ["-c", str(CONSTRAINTS), str(wheel)]
    if subprocess.run(command, capture_output=True, timeout=1200).returncode != 0:
        WHEELHOUSE.mkdir(parents=True, exist_ok=True)
        local = [f"--find-links={LOCAL_WHEELS}"] if LOCAL_WHEELS.is_dir() else []
        _check(
            # `pip wheel`, not `download`: a dependency published only as an sdist
            # is built once here, so later offline installs need no build tools
            [str(python), "-m", "pip", "wheel", "--quiet", "-w", str(WHEELHOUSE)]
            + local
            + ["-c", str(CONSTRAINTS), str(wheel)]
        )
        for stale in WHEELHOUSE.glob("etfold-*.whl"):  # pip wheel copies ours there too
            stale.unlink()
        _check(command)


@pytest.fixture
def venv(tmp_path):
    """A fresh venv, removed afterwards (it holds a full torch)."""
    path = tmp_path / "venv"
    _check([sys._base_executable, "-m", "venv", str(path)])
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_wheel_installs_into_a_fresh_venv_and_reports_from_outside_the_checkout(tmp_path, venv):
    wheel = _build_wheel(tmp_path)
    python = venv / "bin" / "python"
    _install(python, wheel)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    where = _check([str(python), "-c", "import etfold; print(etfold.__file__)"], cwd=elsewhere)
    assert Path(where.stdout.strip()).is_relative_to(venv)

    models = ["--model", "conv_block", "--model", "conv_block_int8", "--model", "gemma3_tiny_bf16"]
    result = _check(
        [str(venv / "bin" / "etfold"), "report", *models, "--json", "--budget", "0.2"],
        cwd=elsewhere,
        env=env,
    )
    stock, ours = json.loads(result.stdout)
    assert (stock["model"], stock["flavour"], ours["flavour"]) == ("conv_block", "stock", "etfold")
    for row in (stock, ours):
        assert row["failure"] is None and row["delegates"] == 1 and row["ops_outside"] == {}
        assert row["max_error"] < 1e-4 and row["median_ms"] > 0
    assert stock["pte_bytes"] == ours["pte_bytes"] > 0
    assert ours["ratio_p10"] <= ours["ratio"] <= ours["ratio_p90"]
    # stderr: one line per skipped extra, one progress line; no warnings, no runtime chatter
    assert result.stderr.splitlines()[:2] == [
        "skipped conv_block_int8: pip install 'etfold[arm]' to run it",
        "skipped gemma3_tiny_bf16: pip install 'etfold[report]' to run it",
    ]
    (progress,) = result.stderr.splitlines()[2:]
    assert progress.startswith("[1/1] conv_block (xnnpack) … ") and progress.endswith(" s, ok")
