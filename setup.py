# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Maps the ExecuTorch-shaped top level (backends/, exir/) under the etfold namespace."""

from setuptools import find_packages, setup

_ROOTS = {"etfold": "etfold", "etfold.backends": "backends", "etfold.exir": "exir"}


def _packages_under(prefix: str, directory: str) -> list[str]:
    return [prefix] + [f"{prefix}.{name}" for name in find_packages(directory)]


setup(
    package_dir=_ROOTS,
    packages=[
        pkg for prefix, directory in _ROOTS.items() for pkg in _packages_under(prefix, directory)
    ],
)
