# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The user's ExportedProgram comes back as it went in, through every etfold hook that
upstream calls on the Arm path with `register_arm_folds()`: the annotation pipeline
(quantization), the partitioner's pre-decomposition hook and the backend pipeline."""

from __future__ import annotations

import copy

import pytest
import torch
from executorch.backends.arm.tosa.partitioner import TOSAPartitioner

from etfold.backends.arm import arm_folds_registered, is_carried_quant_state
from etfold.harness.tosa_runner import (
    FP,
    INT,
    compile_spec,
    lower_tosa,
    quantize_exported_for_tosa,
)


def fingerprint(program: torch.export.ExportedProgram) -> tuple:
    """What a user can observe of their program: the code, the signature, every node's
    metadata (the objects held, and the contents of `custom`), the state tensors and
    constants (which objects, and their values)."""
    meta = [
        (
            node.name,
            tuple(sorted((key, id(value)) for key, value in node.meta.items())),
            tuple(sorted(node.meta.get("custom", {}).items())),
        )
        for node in program.graph.nodes
    ]

    def tensors(mapping):
        return {k: (id(v), v.detach().clone()) for k, v in mapping.items()}

    return (
        program.graph_module.code,
        str(program.graph_signature),
        meta,
        tensors(program.state_dict),
        tensors({k: v for k, v in program.constants.items() if isinstance(v, torch.Tensor)}),
    )


def assert_same(before: tuple, after: tuple) -> None:
    assert before[:3] == after[:3]
    for expected, actual in zip(before[3:], after[3:], strict=True):
        assert expected.keys() == actual.keys()
        for name, (identity, value) in expected.items():
            assert actual[name][0] == identity, name
            assert torch.equal(actual[name][1], value), name


class StateWrittenInPlace(torch.nn.Module):
    """A buffer written in place with a scaled conv (the write-back marks fire), and a
    second scaled conv feeding the output (the scalar-mul fold fires)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.out = torch.nn.Conv2d(4, 4, 1)
        self.register_buffer("state", torch.zeros(1, 4, 6, 6))

    def forward(self, x):
        self.state.copy_(self.conv(x) * 0.5)
        return self.out(self.state) * 0.3


def _program(functionalized: bool):
    torch.manual_seed(0)
    x = torch.randn(1, 4, 6, 6)
    program = torch.export.export(StateWrittenInPlace().eval(), (x,))
    return (program.run_decompositions({}) if functionalized else program), (x,)


@pytest.mark.parametrize("functionalized", [False, True], ids=["in_place", "functionalized"])
def test_pre_decomposition_hook_marks_a_copy_and_leaves_the_users_program(functionalized):
    program, _ = _program(functionalized)
    before = fingerprint(program)
    with arm_folds_registered():
        handed_on = TOSAPartitioner(compile_spec(FP)).transform_for_pre_decomposition(program)
    assert handed_on is not program
    assert [n.name for n in handed_on.graph.nodes if is_carried_quant_state(n)] == ["mul"]
    assert_same(before, fingerprint(program))


@pytest.mark.parametrize("functionalized", [False, True], ids=["in_place", "functionalized"])
@pytest.mark.parametrize("profile", [INT, FP])
def test_stock_lowering_with_registered_folds_leaves_the_users_program(profile, functionalized):
    program, inputs = _program(functionalized)
    before = fingerprint(program)
    with arm_folds_registered():
        if profile == INT:
            quantized = quantize_exported_for_tosa(program, inputs, calibration=[inputs])
            quantized_before = fingerprint(quantized)
            lower_tosa(quantized, profile)
            assert_same(quantized_before, fingerprint(quantized))
        else:
            lower_tosa(program, profile)
    assert_same(before, fingerprint(program))


def test_users_own_custom_meta_gets_no_annotations_from_decomposition():
    """A user's `custom` dict is not shared with the copy upstream decomposes: torch
    writes its tracing annotations into the dict of the node it traces."""
    program, _ = _program(functionalized=False)
    for node in program.graph.nodes:
        node.meta["custom"] = {"user": node.name}
    expected = copy.deepcopy([n.meta["custom"] for n in program.graph.nodes])
    with arm_folds_registered():
        lower_tosa(program, FP)
    assert [n.meta["custom"] for n in program.graph.nodes] == expected
