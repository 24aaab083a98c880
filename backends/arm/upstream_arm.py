# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""What etfold's Arm registration needs of upstream's Arm backend, looked up and checked.

Each lookup raises `ArmRegistrationError`, naming what moved, when upstream no
longer has the shape registration relies on.
"""

from __future__ import annotations

import importlib

UPSTREAM_PASSES_MODULE = "executorch.backends.arm._passes"
UPSTREAM_PASS_MANAGER_MODULE = "executorch.backends.arm._passes.arm_pass_manager"
UPSTREAM_ETHOS_U_BACKEND_MODULE = "executorch.backends.arm.ethosu.backend"

_PASS_MANAGER_NAMES = (
    "ArmPassManager",
    "register_pass_insertions_before",
    "register_pass_insertions_after",
    "_registered_pass_insertions",
)
_PASS_MANAGER_METHODS = (
    "add_pass",
    "transform_for_annotation_pipeline",
    "_configure_pass_insertions",
    "transform_for_pre_decomposition_pipeline",
    "transform_to_backend_pipeline",
)


class ArmRegistrationError(RuntimeError):
    """Upstream ExecuTorch no longer has the shape etfold's registration relies on."""


def upstream_pass_class(name: str) -> type:
    """The upstream Arm pass class `name` (from `executorch.backends.arm._passes`)."""
    cls = getattr(importlib.import_module(UPSTREAM_PASSES_MODULE), name, None)
    if not isinstance(cls, type):
        raise ArmRegistrationError(
            f"{UPSTREAM_PASSES_MODULE}.{name} is gone: etfold's Arm registration anchors on it "
            "(see etfold.backends.arm.pass_insertions.ARM_PASS_INSERTIONS)"
        )
    return cls


def pass_manager_module():
    """Upstream's arm_pass_manager module, with every name and method registration uses."""
    module = importlib.import_module(UPSTREAM_PASS_MANAGER_MODULE)
    missing = [name for name in _PASS_MANAGER_NAMES if not hasattr(module, name)]
    manager = getattr(module, "ArmPassManager", None)
    if manager is not None:
        missing += [
            f"ArmPassManager.{method}"
            for method in _PASS_MANAGER_METHODS
            if not callable(manager.__dict__.get(method))
        ]
    if missing:
        raise ArmRegistrationError(
            f"{UPSTREAM_PASS_MANAGER_MODULE} changed shape; missing: {missing}"
        )
    return module


def ethos_u_backend() -> type:
    """Upstream's EthosUBackend, whose `preprocess` is still a staticmethod."""
    module = importlib.import_module(UPSTREAM_ETHOS_U_BACKEND_MODULE)
    backend = getattr(module, "EthosUBackend", None)
    if not isinstance(backend, type) or not isinstance(
        backend.__dict__.get("preprocess"), staticmethod
    ):
        raise ArmRegistrationError(
            f"{UPSTREAM_ETHOS_U_BACKEND_MODULE}.EthosUBackend.preprocess is no longer a "
            "staticmethod; etfold tells backend passes the Ethos-U target through it"
        )
    return backend
