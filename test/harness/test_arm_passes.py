# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A lowering pair from one edge stage gives what two separate lowerings give."""

import pytest
import torch
from executorch.backends.arm._passes.insert_table_ops import InsertTableOpsPass
from executorch.exir.program import _program

from etfold.backends.arm._passes.fold_dyt_alpha_into_lut_pass import FoldDyTAlphaIntoLUTPass
from etfold.decisions import collect_decisions, record_applied
from etfold.harness.arm_passes import lower_tosa_with_passes, lower_tosa_without_and_with_passes
from etfold.harness.tosa_runner import quantize_for_tosa


class ScaledTanh(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(0.5 * x)


@pytest.fixture(scope="module")
def program():
    generator = torch.Generator().manual_seed(0)
    samples = [(3 * torch.randn(1, 3, 6, 6, generator=generator),) for _ in range(3)]
    return quantize_for_tosa(ScaledTanh().eval(), samples[0], calibration=samples[1:])


def _alpha_fold():
    return {InsertTableOpsPass: [FoldDyTAlphaIntoLUTPass()]}


def _counting_edge_stages(monkeypatch, record_a_decision=False) -> list:
    calls = []
    original = _program._gen_edge_manager_for_partitioners

    def counted(*args, **kwargs):
        calls.append(1)
        if record_a_decision:
            record_applied("probe.edge_stage", "edge stage")
        return original(*args, **kwargs)

    monkeypatch.setattr(_program, "_gen_edge_manager_for_partitioners", counted)
    return calls


def _described(lowered, decisions):
    return lowered.tosa_graphs, [(d.fold, d.applied, d.where, d.detail) for d in decisions]


def test_the_pair_runs_one_edge_stage_and_lowers_as_two_separate_lowerings(program, monkeypatch):
    with collect_decisions() as alone:
        separately = lower_tosa_with_passes(program, before=_alpha_fold())
    calls = _counting_edge_stages(monkeypatch)
    counted = _program._gen_edge_manager_for_partitioners
    without, with_passes, decisions = lower_tosa_without_and_with_passes(
        program, before=_alpha_fold()
    )
    assert len(calls) == 1 and _program._gen_edge_manager_for_partitioners is counted
    assert [d.fold for d in decisions] == ["arm.dyt_alpha_into_lut"]
    assert _described(with_passes, decisions) == _described(separately, alone)
    assert without.tosa_graphs == lower_tosa_with_passes(program).tosa_graphs
    assert without.operator_counts()["MUL"] == with_passes.operator_counts()["MUL"] + 1


def test_an_edge_stage_that_records_a_decision_runs_again_for_the_second_lowering(
    program, monkeypatch
):
    calls = _counting_edge_stages(monkeypatch, record_a_decision=True)
    _, _, decisions = lower_tosa_without_and_with_passes(program, before=_alpha_fold())
    assert len(calls) == 2
    assert [d.fold for d in decisions] == ["probe.edge_stage", "arm.dyt_alpha_into_lut"]
