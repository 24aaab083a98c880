# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The executorch and torch releases etfold supports, and a check of what is installed.

etfold's folds plug into executorch 1.5.1's extension points and some of its
private attributes, and its lowering speed-ups wrap torch 2.13 internals, so
those are the releases it supports (the package metadata pins executorch to
1.5.1). `import etfold` warns once, with `UnsupportedVersionWarning`, when
another release is installed.

`RELEASES` is the one version table: the releases supported, which the import
warning checks, and the exact releases the lowering speed-ups were tested
against (`exir/program/speedups.py`: any other switches them off). It sits in the
toolkit layer, so every layer may read it.

Versions are read from the packages' own `version.py` files without importing
them: `import etfold` stays cheap and torch-free.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

# distribution -> (the supported release, as a prefix of its public version when it ends
# in "."; the exact releases the lowering speed-ups were written and tested against)
RELEASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "executorch": ("1.5.1", ("1.5.1",)),
    "torch": ("2.13.", ("2.13.0",)),
}
SUPPORTED: dict[str, str] = {name: supported for name, (supported, _) in RELEASES.items()}


def tested_releases() -> dict[str, tuple[str, ...]]:
    """Distribution -> the exact releases the lowering speed-ups were tested against."""
    return {name: tested for name, (_, tested) in RELEASES.items()}


class UnsupportedVersionWarning(UserWarning):
    """An executorch or torch release etfold was not written and tested for."""


def supported_text() -> str:
    """`executorch 1.5.1 with torch 2.13.x`: a prefix release reads as any patch of it."""
    executorch, torch = (SUPPORTED[n] for n in ("executorch", "torch"))
    return f"executorch {executorch} with torch {torch}{'x' if torch.endswith('.') else ''}"


def installed_version(package: str) -> str | None:
    """The public version (no local `+cpu` part) of an installed package, or None."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "version.py"
        if path.is_file():
            found = re.search(r"""__version__\s*=\s*['"]([^'"]+)['"]""", path.read_text())
            if found:
                return found.group(1).split("+")[0]
    return None


def _matches(version: str, supported: str) -> bool:
    return version.startswith(supported) if supported.endswith(".") else version == supported


def unsupported() -> list[str]:
    """One phrase per installed package whose release etfold does not support."""
    problems = []
    for package, supported in SUPPORTED.items():
        version = installed_version(package)
        if version is not None and not _matches(version, supported):
            problems.append(f"{package} {version}")
    return problems


def warn_if_unsupported() -> None:
    problems = unsupported()
    if problems:
        warnings.warn(
            f"etfold supports {supported_text()}; found {', '.join(problems)}. "
            "Its folds read that release's internals: expect errors or declined folds.",
            UnsupportedVersionWarning,
            stacklevel=3,
        )
