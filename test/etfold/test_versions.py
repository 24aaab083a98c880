# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""One version policy: `import etfold` names the supported releases when another is
installed, and reads the versions without importing torch or executorch. One table
(`versions.RELEASES`) holds both what the import accepts and the exact releases the
lowering speed-ups were tested against."""

import os
import subprocess
import sys
import textwrap

import pytest

from etfold import versions


def test_the_installed_releases_are_the_supported_ones():
    assert versions.installed_version("executorch") == "1.5.1"
    assert versions.installed_version("torch").startswith("2.13.")
    assert versions.unsupported() == []


@pytest.mark.parametrize(
    "installed, expected",
    [
        ({"executorch": "1.5.1", "torch": "2.13.1"}, []),
        ({"executorch": "1.5.2", "torch": "2.13.0"}, ["executorch 1.5.2"]),
        ({"executorch": "1.5.1", "torch": "2.14.0"}, ["torch 2.14.0"]),
        ({"executorch": "1.5.10", "torch": "2.1.3"}, ["executorch 1.5.10", "torch 2.1.3"]),
        ({"executorch": None, "torch": None}, []),  # nothing installed: pip says so first
    ],
)
def test_unsupported_names_each_other_release(monkeypatch, installed, expected):
    monkeypatch.setattr(versions, "installed_version", installed.get)
    assert versions.unsupported() == expected


def _fake_package(root, name: str, version: str) -> None:
    package = root / name
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('etfold must not import me')\n")
    (package / "version.py").write_text(f"__version__ = '{version}+cpu'\n")


def test_import_etfold_warns_once_naming_what_is_supported(tmp_path):
    _fake_package(tmp_path, "executorch", "1.6.0")
    probe = textwrap.dedent(
        """
        import sys, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import etfold
            import etfold.decisions
        print(len(caught), caught[0].category.__name__ if caught else "")
        print(caught[0].message if caught else "")
        print("torch" in sys.modules, "executorch" in sys.modules)
        """
    )
    environment = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=environment, timeout=60
    )
    assert result.returncode == 0, result.stderr
    count, message, imported = result.stdout.splitlines()
    assert count == "1 UnsupportedVersionWarning"
    assert message.startswith("etfold supports executorch 1.5.1 with torch 2.13.x")
    assert "found executorch 1.6.0" in message
    assert imported == "False False"


def test_one_table_gives_the_import_warning_and_the_speedups_their_releases():
    from etfold.exir.program import speedups

    assert versions.tested_releases() == speedups.TESTED_VERSIONS
    for name, (supported, tested) in versions.RELEASES.items():
        assert versions.SUPPORTED[name] == supported and tested
        assert all(versions._matches(release, supported) for release in tested)
    assert versions.supported_text() == "executorch 1.5.1 with torch 2.13.x"


def test_a_supported_release_the_speedups_were_not_tested_on_turns_only_them_off(monkeypatch):
    from etfold.exir.program import speedups

    installed = {"executorch": "1.5.1", "torch": "2.13.1"}
    monkeypatch.setattr(versions, "installed_version", installed.get)
    monkeypatch.setattr(speedups, "_release", installed.get)
    assert versions.unsupported() == []
    assert speedups.untested_versions() == ["torch 2.13.1 (tested: 2.13.0)"]
