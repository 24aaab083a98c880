# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""ruff is configured in pyproject.toml and the tree is clean."""

import re
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


HEADER = "# Copyright (c) etfold contributors.\n# All rights reserved.\n"
COMMENT_ISSUE_NUMBER = re.compile(r"#.*\bissue\s+#?\d+", re.IGNORECASE)


def _python_sources() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:  # not a git checkout (an sdist): every file below the root
        return sorted(p for p in ROOT.rglob("*.py") if ".venv" not in p.parts)
    return [ROOT / name for name in listed.stdout.split() if (ROOT / name).exists()]


def test_every_source_file_carries_the_license_header():
    missing = [
        str(p.relative_to(ROOT))
        for p in _python_sources()
        if HEADER not in p.read_text().split("\n\n", 1)[0] + "\n"
    ]
    assert not missing and (ROOT / "LICENSE").exists(), missing


def test_no_comment_names_an_issue_number():
    found = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in _python_sources()
        for n, line in enumerate(p.read_text().splitlines(), start=1)
        if COMMENT_ISSUE_NUMBER.search(line)
    ]
    assert not found, found
