# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""register_arm_folds(): etfold's passes where upstream's ran, upstream's unguarded fold nowhere.

The final pass lists of both pipelines are read from real ArmPassManager runs
(the backend pipeline through a real TOSA lowering) for TOSA-1.0+INT and
TOSA-1.0+FP, with and without registration.
"""

from __future__ import annotations

import copy

import pytest
import torch
from executorch.backends.arm._passes import FoldScalarMulIntoConvPass as UpstreamFold
from executorch.backends.arm._passes import InsertTableOpsPass, RewriteConvPass
from executorch.backends.arm._passes import arm_pass_manager as apm
from executorch.backends.arm.ethosu.backend import EthosUBackend

from etfold.backends.arm import (
    ArmPassInsertion,
    ArmRegistrationError,
    FoldScalarMulIntoConvPass,
    are_arm_folds_registered,
    arm_folds_registered,
    register_arm_folds,
    registration,
    unregister_arm_folds,
)
from etfold.backends.arm.registration import upstream_folds_retired
from etfold.demo_models.plain_models import ConvBlock
from etfold.harness.arm_passes import annotation_pipeline_passes
from etfold.harness.tosa_runner import FP, INT, lower_module_tosa

PROFILES = [INT, FP]


@pytest.fixture(autouse=True)
def _unregistered():
    unregister_arm_folds()
    yield
    unregister_arm_folds()


def _snapshot():
    """What registration may touch upstream: ArmPassManager methods, EthosUBackend.preprocess, the insertion registry."""
    return (
        apm.ArmPassManager.__dict__["add_pass"],
        apm.ArmPassManager.__dict__["transform_for_pre_decomposition_pipeline"],
        apm.ArmPassManager.__dict__["transform_to_backend_pipeline"],
        apm.ArmPassManager.__dict__["transform_for_annotation_pipeline"],
        EthosUBackend.__dict__["preprocess"],
        {
            t: ([id(p) for p in i.before_passes], [id(p) for p in i.after_passes])
            for t, i in apm._registered_pass_insertions.items()
        },
    )


def _entry_type(entry: ArmPassInsertion) -> type:
    return type(entry.factory())


def _expected(upstream: list[type], pipeline: str) -> list[type]:
    """Upstream's list with retired passes dropped and every entry placed at its anchor."""
    retired = {
        registration._upstream_pass_class(name) for name in registration.RETIRED_UPSTREAM_PASSES
    }
    entries = [e for e in registration.ARM_PASS_INSERTIONS if e.pipeline == pipeline]
    result = []
    for cls in upstream:
        result += [
            _entry_type(e) for e in entries if e.anchor == cls.__name__ and e.position == "before"
        ]
        if cls not in retired:
            result.append(cls)
        result += [
            _entry_type(e) for e in entries if e.anchor == cls.__name__ and e.position == "after"
        ]
    return result


def _lower_recording_backend_passes(profile: str, monkeypatch) -> tuple[list[type], list[bytes]]:
    recorded: list[list[type]] = []
    original = apm.ArmPassManager._transform

    def recording(self, exported_program, graph_module):
        recorded.append([type(p) for p in self.passes])
        return original(self, exported_program, graph_module)

    monkeypatch.setattr(apm.ArmPassManager, "_transform", recording)
    torch.manual_seed(0)
    model, inputs = ConvBlock(3, 8).eval(), (torch.randn(1, 3, 8, 8),)
    program, _ = lower_module_tosa(copy.deepcopy(model), inputs, profile)
    monkeypatch.setattr(apm.ArmPassManager, "_transform", original)
    assert len(recorded) == 1
    return recorded[0], program.tosa_graphs


@pytest.mark.parametrize("profile", PROFILES)
def test_backend_pipeline_and_byte_identical_tosa_for_nothing_to_fold(profile, monkeypatch):
    upstream_passes, upstream_tosa = _lower_recording_backend_passes(profile, monkeypatch)
    with arm_folds_registered():
        passes, tosa = _lower_recording_backend_passes(profile, monkeypatch)

    assert UpstreamFold in upstream_passes and UpstreamFold not in passes
    assert passes == _expected(upstream_passes, "backend")
    rewrite = passes.index(RewriteConvPass)
    assert passes[rewrite - 1] is FoldScalarMulIntoConvPass
    assert upstream_passes.index(UpstreamFold) == upstream_passes.index(RewriteConvPass) - 1
    dyt = {
        e.fold: _entry_type(e)
        for e in registration.ARM_PASS_INSERTIONS
        if e.anchor == "InsertTableOpsPass"
    }
    if dyt:  # the DyT integer folds sit around InsertTableOpsPass
        table = passes.index(InsertTableOpsPass)
        assert passes[table - 1] is dyt["arm.dyt_alpha_into_lut"]
        assert passes[table + 1] is dyt["arm.dyt_affine_into_conv"]

    assert tosa == upstream_tosa  # byte for byte


@pytest.mark.parametrize("profile", PROFILES)
def test_annotation_pipeline_puts_etfold_fold_in_upstream_slot(profile):
    upstream_passes = annotation_pipeline_passes(profile)
    with arm_folds_registered():
        passes = annotation_pipeline_passes(profile)
    assert UpstreamFold in upstream_passes and UpstreamFold not in passes
    assert passes.index(FoldScalarMulIntoConvPass) == upstream_passes.index(UpstreamFold)
    assert passes == _expected(upstream_passes, "annotation")
    assert annotation_pipeline_passes(profile) == upstream_passes  # unregistered again


def test_upstream_retired_alone_runs_neither_fold():
    with upstream_folds_retired():
        passes = annotation_pipeline_passes(INT)
    assert UpstreamFold not in passes and FoldScalarMulIntoConvPass not in passes


def test_register_twice_changes_nothing_and_unregister_restores_upstream():
    untouched = _snapshot()
    register_arm_folds()
    once, once_passes = _snapshot(), annotation_pipeline_passes(INT)
    register_arm_folds()
    assert _snapshot() == once
    assert annotation_pipeline_passes(INT) == once_passes
    assert once != untouched
    assert are_arm_folds_registered()
    unregister_arm_folds()
    unregister_arm_folds()
    assert _snapshot() == untouched
    assert not are_arm_folds_registered()


def test_context_manager_leaves_registration_as_it_found_it():
    with arm_folds_registered():
        with arm_folds_registered():
            pass
        assert are_arm_folds_registered()
    assert not are_arm_folds_registered()
    register_arm_folds()
    with arm_folds_registered():
        pass
    assert are_arm_folds_registered()


def test_register_used_as_a_context_manager_restores_upstream_exactly():
    untouched = _snapshot()
    with register_arm_folds():
        assert are_arm_folds_registered() and _snapshot() != untouched
    assert _snapshot() == untouched and not are_arm_folds_registered()
    with pytest.raises(RuntimeError, match="planted"), register_arm_folds():
        raise RuntimeError("planted")
    assert _snapshot() == untouched


def test_every_backend_entry_is_in_the_upstream_registry_once():
    register_arm_folds()
    for entry in registration.ARM_PASS_INSERTIONS:
        if entry.pipeline != "backend":
            continue
        insertions = apm._registered_pass_insertions[
            registration._upstream_pass_class(entry.anchor)
        ]
        passes = insertions.before_passes if entry.position == "before" else insertions.after_passes
        assert sum(type(p) is _entry_type(entry) for p in passes) == 1


@pytest.mark.parametrize(
    "bad",
    [
        ArmPassInsertion(
            "test.missing", FoldScalarMulIntoConvPass, "NoSuchUpstreamPass", "before", "backend"
        ),
        # RewriteConvPass exists but is never added to the annotation pipeline
        ArmPassInsertion(
            "test.not_in_annotation",
            FoldScalarMulIntoConvPass,
            "RewriteConvPass",
            "before",
            "annotation",
        ),
    ],
    ids=["unknown_anchor", "anchor_not_in_pipeline"],
)
def test_fails_loudly_and_leaves_upstream_untouched_when_upstream_moved(bad, monkeypatch):
    untouched = _snapshot()
    monkeypatch.setattr(
        registration, "ARM_PASS_INSERTIONS", (*registration.ARM_PASS_INSERTIONS, bad)
    )
    with pytest.raises(ArmRegistrationError):
        register_arm_folds()
    assert _snapshot() == untouched
    assert not are_arm_folds_registered()
