# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""How etfold's Arm passes enter ArmPassManager pipelines: register, unregister.

Nothing is registered on import: `register_arm_folds()` installs, and
`unregister_arm_folds()` restores upstream exactly. Registration does four
jobs, each in its own module:

- the insertion table, `ARM_PASS_INSERTIONS`, and how its entries reach both
  pipelines, retired upstream passes dropped (`pass_insertions.py`);
- write-backs marked as carried state before partitioning
  (`carried_state_marking.py`);
- the Ethos-U target told to backend passes (`ethos_u_target.py`);
- the upstream attributes these replace, and their one restore
  (`upstream_patches.py`), after upstream's shape is checked
  (`upstream_arm.py`, `ArmRegistrationError` when anything moved).

Why registration is process-wide: the quantizer's annotation hook and the pass
manager that runs the folds are reached from the user's own `prepare_pt2e` and
`to_edge_transform_and_lower` calls, which etfold does not wrap, so the user says how
long it lasts: `with register_arm_folds(): ...` for one block, or until
`unregister_arm_folds()`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from etfold.backends.arm.carried_state_marking import on_a_marked_copy
from etfold.backends.arm.ethos_u_target import preprocess_for_its_target, target_aware
from etfold.backends.arm.pass_insertions import (
    ARM_PASS_INSERTIONS,
    RETIRED_UPSTREAM_PASSES,
    ArmPassInsertion,
    LazyPass,
    Pipeline,
    Position,
    add_pass_insertions,
    check_annotation_anchors,
    inserting_add_pass,
    lazy_pass,
    remove_pass_insertions,
)
from etfold.backends.arm.pt2e_fusion_guard import FUSIONS as PT2E_FUSIONS
from etfold.backends.arm.pt2e_fusion_guard import (
    fusion_with_own_constants,
    pt2e_prepare_module,
)
from etfold.backends.arm.upstream_arm import (
    UPSTREAM_ETHOS_U_BACKEND_MODULE,
    UPSTREAM_PASS_MANAGER_MODULE,
    UPSTREAM_PASSES_MODULE,
    ArmRegistrationError,
    ethos_u_backend,
    pass_manager_module,
)
from etfold.backends.arm.upstream_arm import upstream_pass_class as _upstream_pass_class
from etfold.backends.arm.upstream_patches import Replaced, replace, restore

__all__ = [
    "ARM_PASS_INSERTIONS",
    "RETIRED_UPSTREAM_PASSES",
    "UPSTREAM_ETHOS_U_BACKEND_MODULE",
    "UPSTREAM_PASS_MANAGER_MODULE",
    "UPSTREAM_PASSES_MODULE",
    "ArmFoldsRegistration",
    "ArmPassInsertion",
    "ArmRegistrationError",
    "LazyPass",
    "Pipeline",
    "Position",
    "add_pass_insertions",
    "are_arm_folds_registered",
    "arm_folds_registered",
    "lazy_pass",
    "register_arm_folds",
    "remove_pass_insertions",
    "unregister_arm_folds",
    "upstream_folds_retired",
]


@dataclass
class _Installed:
    replaced: list[Replaced]
    registry_entries: list[tuple[type, Position, Any]]  # (anchor type, position, instance)
    created_registry_keys: list[type]
    insertions: tuple[ArmPassInsertion, ...]


_installed: _Installed | None = None
_lock = threading.RLock()  # registering and unregistering from several threads


def _replace_upstream(insertions: tuple[ArmPassInsertion, ...]) -> list[Replaced]:
    manager = pass_manager_module().ArmPassManager
    if hasattr(manager.__dict__["add_pass"], "__etfold_wrapped__"):
        raise ArmRegistrationError(
            "ArmPassManager.add_pass is already wrapped by another etfold install"
        )
    retired = tuple(_upstream_pass_class(name) for name in RETIRED_UPSTREAM_PASSES)
    ethos_u = ethos_u_backend()
    prepare = pt2e_prepare_module()
    return [
        replace(manager, "add_pass", inserting_add_pass(retired, insertions)),
        replace(manager, "transform_for_pre_decomposition_pipeline", on_a_marked_copy),
        replace(manager, "transform_to_backend_pipeline", target_aware),
        replace(manager, "transform_for_annotation_pipeline", target_aware),
        replace(ethos_u, "preprocess", preprocess_for_its_target),
        *(replace(prepare, name, fusion_with_own_constants) for name in PT2E_FUSIONS),
    ]


def _install(insertions: tuple[ArmPassInsertion, ...]) -> None:
    global _installed
    if _installed is not None:
        if _installed.insertions != insertions:
            raise ArmRegistrationError(
                "a different set of etfold Arm passes is registered; unregister it first"
            )
        return
    anchors = {e.anchor: _upstream_pass_class(e.anchor) for e in insertions}
    replaced = _replace_upstream(insertions)
    try:
        check_annotation_anchors(insertions)
        backend = [e for e in insertions if e.pipeline == "backend"]
        instances = [e.factory() for e in backend]
    except BaseException:
        restore(replaced)
        raise
    entries = [
        (anchors[entry.anchor], entry.position, instance)
        for entry, instance in zip(backend, instances, strict=True)
    ]
    created = add_pass_insertions(entries)
    _installed = _Installed(replaced, entries, created, insertions)


def _uninstall() -> None:
    global _installed
    if _installed is None:
        return
    restore(_installed.replaced)
    remove_pass_insertions(_installed.registry_entries, _installed.created_registry_keys)
    _installed = None


class ArmFoldsRegistration:
    """What `register_arm_folds()` returns: used in a `with`, it leaves registration
    as it found it when the block ends (the plain call stays registered)."""

    def __init__(self, was_registered: bool):
        self._was_registered = was_registered

    def __enter__(self) -> ArmFoldsRegistration:
        return self

    def __exit__(self, *exc) -> None:
        if not self._was_registered:
            unregister_arm_folds()


def register_arm_folds() -> ArmFoldsRegistration:
    """Install etfold's Arm passes into both pipelines; calling it again changes nothing.

    `with register_arm_folds(): ...` scopes the registration to the block.
    """
    with _lock:
        was_registered = _installed is not None
        _install(ARM_PASS_INSERTIONS)
    return ArmFoldsRegistration(was_registered)


def unregister_arm_folds() -> None:
    """Restore upstream exactly: every replaced attribute, and the registry without etfold's
    passes."""
    with _lock:
        _uninstall()


def are_arm_folds_registered() -> bool:
    return _installed is not None and _installed.insertions == ARM_PASS_INSERTIONS


def arm_folds_registered() -> ArmFoldsRegistration:
    """Register for a `with` block; leave registration as it was afterwards."""
    return register_arm_folds()


@contextlib.contextmanager
def upstream_folds_retired() -> Iterator[None]:
    """Neither upstream's retired passes nor etfold's run: the unfolded baseline for comparisons."""
    if _installed is not None:
        raise ArmRegistrationError("unregister etfold's Arm folds before retiring upstream's alone")
    _install(())
    try:
        yield
    finally:
        unregister_arm_folds()
