# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The built wheel holds every module of the checkout and runs `etfold report` from
outside it.

Two profiles. The short one (in `make test`) builds the wheel, checks what it
holds, and runs it unpacked, ahead of the editable install on `sys.path`. The
long one (`make test-wheel`, marker `long`) installs the wheel non-editable
into a fresh venv with the constraints and no extras (an XNNPACK-only user):
the XNNPACK rows run, models needing `arm` or `report` are skipped by name.
Everything either profile writes (the source copy, the wheel, the venv, pip's
cache) lives in the test's temporary directory: no run depends on another's.
"""

import configparser
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
LOCAL_WHEELS = Path("/opt/wheels")  # where a machine keeps the CPU torch, when it does
PACKAGE_ROOTS = {"etfold": "etfold", "backends": "etfold/backends", "exir": "etfold/exir"}
SOURCES = ("pyproject.toml", "setup.py", "README.md", *PACKAGE_ROOTS)
REPORT_MODELS = ["--model", "conv_block", "--model", "conv_block_int8"]
REPORT_MODELS += ["--model", "gemma3_tiny_bf16"]


def _check(command: list, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=1500, **kwargs)
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a clean copy of the sources, so no stale build/ of the checkout leaks in."""
    tmp_path = tmp_path_factory.mktemp("wheel")
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
        + ["--no-cache-dir", "--quiet", "-w", str(out), str(source)],
        env=_clean_env(PIP_NO_CACHE_DIR="1"),
    )
    (built,) = out.glob("etfold-*.whl")
    return built


def _checkout_modules() -> set[str]:
    """Every module of the three package roots, as the wheel must name it."""
    found = set()
    for directory, prefix in PACKAGE_ROOTS.items():
        for path in (ROOT / directory).rglob("*.py"):
            relative = path.relative_to(ROOT / directory)
            found.add(f"{prefix}/{relative.as_posix()}")
    return found


def test_wheel_holds_every_module_and_the_console_script(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = configparser.ConfigParser()
        scripts.read_string(archive.read(entry_points).decode())
    assert _checkout_modules() <= names
    assert not [n for n in names if n.startswith(("test/", "bench/", "tools/"))]
    assert scripts["console_scripts"]["etfold"] == "etfold.cli:main"


def _conv_block_rows(stdout: str) -> tuple[dict, dict]:
    """conv_block's stock and etfold rows, checked: one delegate each, nothing outside."""
    stock, ours = json.loads(stdout)
    assert (stock["model"], stock["flavour"], ours["flavour"]) == ("conv_block", "stock", "etfold")
    for row in (stock, ours):
        assert row["failure"] is None and row["delegates"] == 1 and row["ops_outside"] == {}
        assert row["max_error"] < 1e-4 and row["median_ms"] > 0
    assert stock["pte_bytes"] == ours["pte_bytes"] > 0
    return stock, ours


def test_unpacked_wheel_reports_from_outside_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # the unpacked wheel comes before the editable install, whose finder sits last
    run = (
        "import sys; sys.path.insert(0, sys.argv[1]); import etfold, etfold.cli;"
        "assert etfold.__file__.startswith(sys.argv[1]), etfold.__file__;"
        "sys.exit(etfold.cli.main(sys.argv[2:]))"
    )
    report = ["report", "--model", "conv_block", "--json", "--budget", "0.2"]
    result = _check(
        [sys.executable, "-c", run, str(site), *report], cwd=elsewhere, env=_clean_env()
    )
    _conv_block_rows(result.stdout)


def _install(python: Path, wheel: Path, cache: Path) -> None:
    """From the machine's configured indexes, with a pip cache of this test's own."""
    local = [f"--find-links={LOCAL_WHEELS}"] if LOCAL_WHEELS.is_dir() else []
    _check(
        [str(python), "-m", "pip", "install", "--quiet", "--no-compile", *local]
        + ["-c", str(CONSTRAINTS), str(wheel)],
        env=_clean_env(PIP_CACHE_DIR=str(cache)),
    )


@pytest.mark.long
def test_wheel_installs_into_a_fresh_venv_and_reports_from_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    _check([sys._base_executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    _install(python, wheel, tmp_path / "pip-cache")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = _clean_env()
    where = _check([str(python), "-c", "import etfold; print(etfold.__file__)"], cwd=elsewhere)
    assert Path(where.stdout.strip()).is_relative_to(venv)

    report = [str(venv / "bin" / "etfold"), "report", *REPORT_MODELS, "--json", "--budget", "0.2"]
    result = _check(report, cwd=elsewhere, env=env)
    stock, ours = _conv_block_rows(result.stdout)
    assert ours["ratio_p10"] <= ours["ratio"] <= ours["ratio_p90"]
    # stderr: one line per skipped extra first; no warnings, no runtime chatter
    assert result.stderr.splitlines()[:2] == [
        "skipped conv_block_int8: pip install 'etfold[arm]' to run it",
        "skipped gemma3_tiny_bf16: pip install 'etfold[report]' to run it",
    ]
    assert all("conv_block" in line for line in result.stderr.splitlines()[2:])
