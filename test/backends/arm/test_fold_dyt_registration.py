# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Where register_arm_folds() puts the DyT passes, and that registering twice changes nothing."""

import pytest
import torch
from executorch.backends.arm._passes import InsertTableOpsPass, RewriteConvPass
from executorch.backends.arm._passes import arm_pass_manager as apm
from executorch.backends.arm.tosa.compile_spec import TosaCompileSpec

from etfold.backends.arm import register_arm_folds, unregister_arm_folds
from etfold.backends.arm._passes.fold_dyt_affine_into_conv_float_pass import (
    FoldDyTAffineIntoConvFloatPass,
)
from etfold.backends.arm._passes.fold_dyt_affine_into_conv_pass import FoldDyTAffineIntoConvPass
from etfold.backends.arm._passes.fold_dyt_alpha_into_lut_pass import FoldDyTAlphaIntoLUTPass
from etfold.backends.arm._passes.fold_scalar_mul_into_conv_pass import FoldScalarMulIntoConvPass
from etfold.harness.arm_passes import annotation_pipeline_passes
from etfold.harness.tosa_runner import INT


@pytest.fixture(autouse=True)
def _unregistered():
    unregister_arm_folds()
    yield
    unregister_arm_folds()


def _backend_passes(monkeypatch) -> list[type]:
    """The backend pipeline's pass classes, in order, as ArmPassManager would run them."""
    recorded: list[list[type]] = []

    def record(self, exported_program, graph_module):
        recorded.append([type(p) for p in self.passes])
        return graph_module

    monkeypatch.setattr(apm.ArmPassManager, "_transform", record)
    program = torch.export.export(torch.nn.Linear(2, 2).eval(), (torch.randn(1, 2),))
    apm.ArmPassManager(TosaCompileSpec(INT)).transform_to_backend_pipeline(
        program, program.graph_module
    )
    return recorded[0]


def test_integer_dyt_passes_sit_around_insert_table_ops_before_the_conv_rewrite(monkeypatch):
    register_arm_folds()
    passes = _backend_passes(monkeypatch)
    table = passes.index(InsertTableOpsPass)
    assert passes[table - 1] is FoldDyTAlphaIntoLUTPass
    assert passes[table + 1] is FoldDyTAffineIntoConvPass
    assert passes.index(FoldDyTAffineIntoConvPass) < passes.index(RewriteConvPass)
    assert passes.count(FoldDyTAlphaIntoLUTPass) == passes.count(FoldDyTAffineIntoConvPass) == 1
    assert FoldDyTAffineIntoConvFloatPass not in passes


def test_float_dyt_pass_runs_in_the_annotation_pipeline_after_the_scalar_mul_fold():
    upstream = annotation_pipeline_passes(INT)
    register_arm_folds()
    passes = annotation_pipeline_passes(INT)
    assert FoldDyTAffineIntoConvFloatPass not in upstream
    assert passes.count(FoldDyTAffineIntoConvFloatPass) == 1
    assert passes[passes.index(FoldScalarMulIntoConvPass) + 1] is FoldDyTAffineIntoConvFloatPass
    assert FoldDyTAlphaIntoLUTPass not in passes and FoldDyTAffineIntoConvPass not in passes


def test_registering_twice_changes_nothing(monkeypatch):
    upstream_backend = _backend_passes(monkeypatch)
    register_arm_folds()
    once = (_backend_passes(monkeypatch), annotation_pipeline_passes(INT))
    register_arm_folds()
    assert (_backend_passes(monkeypatch), annotation_pipeline_passes(INT)) == once
    unregister_arm_folds()
    assert _backend_passes(monkeypatch) == upstream_backend
