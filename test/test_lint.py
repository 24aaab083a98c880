"""ruff is configured in pyproject.toml and the tree is clean."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    beside = Path(sys.executable).with_name("ruff")
    found = str(beside) if beside.exists() else shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed; it is a test dependency (pip install -e '.[test]')")
    return [found]


@pytest.mark.parametrize(
    "command", [["check", "."], ["format", "--check", "."]], ids=["check", "format"]
)
def test_ruff_is_clean(command):
    result = subprocess.run(_ruff() + command, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
