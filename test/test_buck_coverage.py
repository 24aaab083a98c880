# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Every Python file under the source and test trees belongs to a BUCK target."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COVERED_TREES = ("backends", "exir", "etfold", "test")


def buck_sources(root: Path) -> set[str]:
    """Every file named in an explicit `srcs` list of a BUCK file under `root`."""
    covered: set[str] = set()
    for buck_file in sorted(root.rglob("BUCK")):
        if ".venv" in buck_file.parts:
            continue
        base = buck_file.parent.relative_to(root)
        for node in ast.walk(ast.parse(buck_file.read_text(), filename=str(buck_file))):
            if isinstance(node, ast.Call):
                for keyword in node.keywords:
                    if keyword.arg == "srcs":
                        covered.update(str(base / src) for src in ast.literal_eval(keyword.value))
    return covered


def python_files(root: Path, trees=COVERED_TREES) -> set[str]:
    return {
        str(path.relative_to(root))
        for tree in trees
        for path in (root / tree).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def test_every_python_file_is_in_a_target():
    missing = sorted(python_files(ROOT) - buck_sources(ROOT))
    assert not missing, f"Python files not covered by any BUCK target: {missing}"


def test_buck_names_only_files_that_exist():
    stale = sorted(src for src in buck_sources(ROOT) if not (ROOT / src).exists())
    assert not stale, f"BUCK names files that do not exist: {stale}"


def test_the_check_notices_an_uncovered_file(tmp_path):
    (tmp_path / "exir").mkdir()
    (tmp_path / "exir" / "covered.py").write_text("")
    (tmp_path / "exir" / "forgotten.py").write_text("")
    (tmp_path / "exir" / "BUCK").write_text(
        'runtime.python_library(name = "x", srcs = ["covered.py"])\n'
    )
    assert python_files(tmp_path, ("exir",)) - buck_sources(tmp_path) == {"exir/forgotten.py"}


def test_buck_targets_fails_on_an_import_cycle_through_a_lazy_relative_import(tmp_path):
    import subprocess
    import sys

    package = tmp_path / "etfold"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "first.py").write_text("from etfold import second\n")
    (package / "second.py").write_text("def late():\n    from .first import late\n")
    tool = Path(__file__).resolve().parents[1] / "tools" / "buck_targets.py"
    result = subprocess.run(
        [sys.executable, str(tool), str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "CYCLE: :etfold_first -> :etfold_second -> :etfold_first" in result.stdout
    (package / "second.py").write_text("def late():\n    return 1\n")
    result = subprocess.run(
        [sys.executable, str(tool), str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode == 0 and "CYCLE" not in result.stdout
