# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The carried-state guard: no scale folds into a conv whose output persists to the next call.

Recurrent cells are lowered for TOSA-1.0+INT and stepped 32 times on the
reference model, carrying their state, against fp32 eager stepped the same way.
"""

from __future__ import annotations

import copy

import pytest
import torch
from executorch.exir import to_edge

from etfold.backends.arm import (
    FoldScalarMulIntoConvPass,
    arm_folds_registered,
    is_carried_quant_state,
    mark_carried_quant_state,
    mark_carried_state_outputs,
)
from etfold.backends.arm._passes import carried_region
from etfold.backends.arm._passes import fold_scalar_mul_into_conv_pass as fold
from etfold.backends.arm._passes.carried_state import mark_write_backs
from etfold.backends.arm.registration import upstream_folds_retired
from etfold.decisions import FoldDecision, collect_decisions
from etfold.harness.tosa_runner import (
    FP,
    INT,
    lower_module_tosa,
    lower_tosa,
    quantize_exported_for_tosa,
    run_carried,
)
from etfold.harness.xnnpack_runner import max_abs_error

STEPS = 32


def mine(journal: list[FoldDecision]) -> list[FoldDecision]:
    """This fold's decisions (other registered folds record theirs too)."""
    return [d for d in journal if d.fold == fold.FOLD]


class StatefulConvMul(torch.nn.Module):
    """state <- conv(x + state) * 0.3; the scaled conv output is written into a buffer."""

    def __init__(self, channels: int = 4, size: int = 6):
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.register_buffer("state", torch.zeros(1, channels, size, size))

    def forward(self, x):
        y = self.conv(x + self.state) * 0.3
        self.state.copy_(y)
        return y


class FunctionalCell(torch.nn.Module):
    """(out, state) = f(x, state): the state is an argument and an output; only a mark says so."""

    def __init__(self, channels: int = 4):
        super().__init__()
        self.conv = torch.nn.Conv2d(2 * channels, channels, 3, padding=1)

    def forward(self, x, h):
        h_next = self.conv(torch.cat([x, h], dim=1)) * 0.5
        return torch.tanh(h_next), h_next


def _steps(seed: int = 0, n: int = STEPS, shape=(1, 4, 6, 6)) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=generator),) for _ in range(n)]


def _eager_buffer_steps(model: StatefulConvMul, steps) -> list[torch.Tensor]:
    model = copy.deepcopy(model)
    model.state.zero_()
    with torch.no_grad():
        return [model(*inputs) for inputs in steps]


def _lower_stateful(model, steps, context):
    calibration = steps[1:9]
    with context(), collect_decisions() as journal:
        program, _ = lower_module_tosa(copy.deepcopy(model), steps[0], INT, calibration=calibration)
    return program, mine(journal)


def test_stateful_conv_mul_keeps_its_mul_and_drifts_no_more_than_unfolded():
    torch.manual_seed(0)
    model, steps = StatefulConvMul().eval(), _steps()
    folded, decisions = _lower_stateful(model, steps, arm_folds_registered)
    unfolded, _ = _lower_stateful(model, steps, upstream_folds_retired)

    assert folded.operator_counts()["MUL"] == 1
    assert [(d.applied, d.detail) for d in decisions] == [(False, fold.CARRIED_STATE)]

    zero = {"state": torch.zeros_like(model.state)}
    eager = _eager_buffer_steps(model, steps)
    folded_outs = [r.outputs[0] for r in run_carried(folded, steps, buffers=zero)]
    unfolded_outs = [r.outputs[0] for r in run_carried(unfolded, steps, buffers=zero)]
    folded_drift = max_abs_error(folded_outs, eager)
    unfolded_drift = max_abs_error(unfolded_outs, eager)
    assert folded_drift <= unfolded_drift
    # the state really carries: later steps differ from a stateless run of the same inputs
    assert not torch.equal(folded_outs[5], folded.run(*steps[5]).outputs[0])


def test_stock_folds_across_the_buffer_write_back():
    """Documents the upstream behaviour the guard prevents."""
    torch.manual_seed(0)
    model, steps = StatefulConvMul().eval(), _steps(n=9)
    stock, _ = _lower_stateful(model, steps, lambda: torch.no_grad())
    assert stock.operator_counts()["MUL"] == 0


@pytest.mark.parametrize("profile", [INT, FP])
def test_marked_functional_state_keeps_its_mul(profile):
    torch.manual_seed(0)
    model = FunctionalCell().eval()
    x, h = torch.randn(1, 4, 6, 6), torch.zeros(1, 4, 6, 6)

    generator = torch.Generator().manual_seed(2)
    calibration = [
        (
            torch.randn(1, 4, 6, 6, generator=generator),
            torch.randn(1, 4, 6, 6, generator=generator) * 0.5,
        )
        for _ in range(4)
    ]

    def lowered(context, mark: bool):
        exported = torch.export.export(copy.deepcopy(model), (x, h))
        if mark:
            mark_carried_state_outputs(exported, [1])
        with context(), collect_decisions() as journal:
            program = (
                quantize_exported_for_tosa(exported, (x, h), calibration=calibration)
                if profile == INT
                else exported
            )
            return lower_tosa(program, profile), mine(journal)

    marked, decisions = lowered(arm_folds_registered, mark=True)
    assert marked.operator_counts()["MUL"] == 1
    assert [(d.applied, d.detail) for d in decisions] == [(False, fold.CARRIED_STATE)]
    unmarked, _ = lowered(arm_folds_registered, mark=False)
    assert unmarked.operator_counts()["MUL"] == 0

    if profile == INT:
        unfolded, _ = lowered(upstream_folds_retired, mark=True)
        eager_h, marked_h, unfolded_h = h, h, h
        marked_drift = unfolded_drift = 0.0
        for (x_t,) in _steps(seed=1):
            with torch.no_grad():
                eager_out, eager_h = model(x_t, eager_h)
            marked_out, marked_h = marked.run(x_t, marked_h).outputs
            unfolded_out, unfolded_h = unfolded.run(x_t, unfolded_h).outputs
            marked_drift = max(marked_drift, max_abs_error([marked_out], [eager_out]))
            unfolded_drift = max(unfolded_drift, max_abs_error([unfolded_out], [eager_out]))
        assert marked_drift <= unfolded_drift


# ---- structural detection, both graph forms ----


class WritesInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x, h):
        y = self.conv(x) * 0.5
        h.copy_(torch.relu(y))  # reaches the write-back through another op
        return y


class UnrelatedCounter(torch.nn.Module):
    """A feed-forward conv × scale beside a buffer the model updates on its own."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x, h):
        self.count.add_(1)
        return self.conv(x + h) * 0.5


def _inputs():
    torch.manual_seed(0)
    return torch.randn(1, 4, 6, 6), torch.randn(1, 4, 6, 6)


@pytest.mark.parametrize("model_cls", [StatefulConvMul, WritesInput], ids=["buffer", "user_input"])
def test_annotation_form_sees_write_backs(model_cls):
    model = model_cls().eval()
    inputs = _inputs()[: 1 if model_cls is StatefulConvMul else 2]
    graph_module = torch.export.export(model, inputs).module(check_guards=False)
    with collect_decisions() as journal:
        assert not FoldScalarMulIntoConvPass(tfa_pass=True)(graph_module).modified
    assert [d.detail for d in mine(journal)] == [fold.CARRIED_STATE]


@pytest.mark.parametrize(
    "model_cls", [StatefulConvMul, WritesInput], ids=["buffer_mutation", "user_input_mutation"]
)
def test_backend_form_sees_the_signature(model_cls):
    model = model_cls().eval()
    inputs = _inputs()[: 1 if model_cls is StatefulConvMul else 2]
    program = to_edge(torch.export.export(model, inputs)).exported_program()
    kinds = {spec.kind.name for spec in program.graph_signature.output_specs}
    assert kinds & {"BUFFER_MUTATION", "USER_INPUT_MUTATION"}
    before = str(program.graph)
    with collect_decisions() as journal:
        assert not FoldScalarMulIntoConvPass(program)(program.graph_module).modified
    assert str(program.graph) == before
    assert [d.detail for d in mine(journal)] == [fold.CARRIED_STATE]


def test_feed_forward_conv_still_folds_beside_unrelated_state():
    model, inputs = UnrelatedCounter().eval(), _inputs()
    graph_module = torch.export.export(copy.deepcopy(model), inputs).module(check_guards=False)
    assert FoldScalarMulIntoConvPass(tfa_pass=True)(graph_module).modified
    with arm_folds_registered(), collect_decisions() as journal:
        program, reference = lower_module_tosa(copy.deepcopy(model), inputs, INT)
    assert [d.applied for d in mine(journal)] == [True]
    assert program.operator_counts()["MUL"] == 0
    out = program.run(*inputs).outputs[-1]
    assert float((out - reference[-1]).abs().max()) <= 0.05


def test_region_holds_exactly_the_ops_that_round_the_carried_value():
    """relu keeps the multiply's quantization, so the multiply rounds the written value;
    the conv's own rounding is upstream of it."""
    graph_module = torch.export.export(WritesInput().eval(), _inputs()).module(check_guards=False)
    names = {n.name for n in carried_region(graph_module)}
    assert names == {"mul", "relu"}


class ScaledGate(torch.nn.Module):
    """state <- tanh(conv(x) * 0.5) + state: the scaled conv feeds the state through a TABLE op."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.register_buffer("state", torch.zeros(1, 4, 6, 6))

    def forward(self, x):
        y = torch.tanh(self.conv(x) * 0.5) + self.state
        self.state.copy_(y)
        return y


def test_a_conv_upstream_of_the_op_that_rounds_the_state_folds():
    model = ScaledGate().eval()
    graph_module = torch.export.export(model, _steps(n=1)[0]).module(check_guards=False)
    assert {n.name for n in carried_region(graph_module)} == {"add"}
    with collect_decisions() as journal:
        assert FoldScalarMulIntoConvPass(tfa_pass=True)(graph_module).modified
    assert [d.applied for d in mine(journal)] == [True]


def test_marks_by_output_index_and_survives_unlifting():
    model = FunctionalCell().eval()
    exported = torch.export.export(model, (torch.randn(1, 4, 6, 6), torch.zeros(1, 4, 6, 6)))
    (marked,) = mark_carried_state_outputs(exported, [1])
    assert marked.name == "mul" and is_carried_quant_state(marked)
    assert not is_carried_quant_state(next(n for n in exported.graph.nodes if n.name == "tanh"))
    unlifted = exported.module(check_guards=False)
    assert [n.name for n in unlifted.graph.nodes if is_carried_quant_state(n)] == ["mul"]
    with pytest.raises(IndexError):
        mark_carried_state_outputs(exported, [2])


def test_mark_does_not_leak_into_nodes_sharing_custom_meta():
    graph_module = torch.export.export(FunctionalCell().eval(), _inputs()).module(
        check_guards=False
    )
    conv, mul = (
        next(n for n in graph_module.graph.nodes if n.name == name) for name in ("conv2d", "mul")
    )
    shared = {"note": 1}
    conv.meta["custom"] = shared
    mul.meta["custom"] = shared
    mark_carried_quant_state(mul)
    assert is_carried_quant_state(mul) and not is_carried_quant_state(conv)
    assert shared == {"note": 1}


def test_fp_write_back_outside_the_delegate_is_seen_through_the_whole_program_marks():
    """On FP the fold runs in the backend pipeline, which sees only the delegate: the
    write-back into `state` happens outside it. The pre-decomposition marks carry it in."""
    torch.manual_seed(0)
    model = StatefulConvMul().eval()
    (x,) = _steps(n=1)[0]
    with arm_folds_registered(), collect_decisions() as journal:
        program, _ = lower_module_tosa(copy.deepcopy(model), (x,), FP)
    assert program.operator_counts()["MUL"] == 1
    assert [(d.applied, d.detail) for d in mine(journal)] == [(False, fold.CARRIED_STATE)]
    zero = {"state": torch.zeros_like(model.state)}
    outs = [r.outputs[0] for r in run_carried(program, _steps(n=4), buffers=zero)]
    eager = _eager_buffer_steps(model, _steps(n=4))
    assert max_abs_error(outs, eager) < 1e-5


def test_mark_write_backs_marks_exactly_the_written_values():
    model = StatefulConvMul().eval()
    program = torch.export.export(model, _steps(n=1)[0])
    (marked,) = mark_write_backs(program)
    assert is_carried_quant_state(marked)
    assert marked.target is torch.ops.aten.mul.Tensor
    assert [n for n in program.graph.nodes if is_carried_quant_state(n)] == [marked]


def test_gru_cell_folds_its_gate_convs_one_step_within_one_lsb_of_unfolded():
    """The report's GRU-like cell: both gate convs are upstream of the op that rounds the
    state (the blend), so they fold; one step from any state stays within one LSB."""
    from etfold.demo_models.arm_npu_blocks import GRU
    from etfold.harness.tosa_runner import output_scales

    module, inputs = GRU[0]()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    lowered = {}
    for name, context in (("etfold", arm_folds_registered), ("unfolded", upstream_folds_retired)):
        with context(), collect_decisions() as journal:
            lowered[name] = lower_module_tosa(module, inputs, INT, calibration=GRU[1]())[0]
        if name == "etfold":
            assert [(d.applied, d.where) for d in mine(journal)] == [
                (True, "annotation:conv2d"),
                (True, "annotation:conv2d_1"),
            ]
    assert lowered["etfold"].operator_counts()["MUL"] == (
        lowered["unfolded"].operator_counts()["MUL"] - 2
    )
    lsb = output_scales(lowered["unfolded"])[0]
    generator = torch.Generator().manual_seed(4)
    for _ in range(3):
        state = {"h": 0.5 * torch.randn(module.h.shape, generator=generator)}
        x = (torch.randn(inputs[0].shape, generator=generator),)
        folded, unfolded = (
            run_carried(lowered[n], [x], buffers=state)[0].outputs[0] for n in lowered
        )
        assert float((folded - unfolded).abs().max()) <= lsb * 1.001
    for name, value in module.state_dict().items():
        assert torch.equal(value, before[name]), name


class StateTimesScale(torch.nn.Module):
    """state <- conv(x + state) * scale: the multiply rounds the carried value itself."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.register_buffer("state", torch.zeros(1, 4, 6, 6))

    def forward(self, x):
        y = self.conv(x + self.state) * self.scale
        self.state.copy_(y)
        return y


def _rolled(model, steps, context, folds=True, run=True):
    """The lowered program's outputs over `steps` from its zero state (None without
    `run`: `steps` then only quantize), its output scale and this fold's decisions."""
    from etfold.backends.arm import arm_folds_registered
    from etfold.backends.arm.registration import upstream_folds_retired
    from etfold.decisions import collect_decisions
    from etfold.harness.tosa_runner import INT, lower_module_tosa, output_scales, run_carried

    registration = arm_folds_registered if folds else upstream_folds_retired
    with context(), registration(), collect_decisions() as journal:
        program, _ = lower_module_tosa(copy.deepcopy(model), steps[0], INT, calibration=steps[1:4])
    outputs = [r.outputs[0] for r in run_carried(program, steps)] if run else None
    return outputs, output_scales(program)[0], [d for d in journal if d.fold == fold.FOLD]


def test_power_of_two_opt_in_folds_into_carried_state_without_drift():
    """The state keeps its quantization; the unfolded multiply's own requantization
    (by the int8 code of the scale) is the only rounding that goes, so the folded
    rollout stays within one step of the unfolded one and no farther from eager."""
    import contextlib

    from etfold.backends.arm import power_of_two_scales_fold_into_carried_state

    torch.manual_seed(0)
    model = StateTimesScale(0.25).eval()
    generator = torch.Generator().manual_seed(5)
    steps = [(torch.randn(1, 4, 6, 6, generator=generator),) for _ in range(24)]
    folded, lsb, decisions = _rolled(model, steps, power_of_two_scales_fold_into_carried_state)
    unfolded, unfolded_lsb, _ = _rolled(model, steps, contextlib.nullcontext, folds=False)
    assert [d.applied for d in decisions] == [True] and lsb == unfolded_lsb
    eager, expected = copy.deepcopy(model), []
    with torch.no_grad():
        expected = [eager(*inputs) for inputs in steps]
    apart = [float((a - b).abs().max()) / lsb for a, b in zip(folded, unfolded, strict=True)]
    assert max(apart) <= 1.0 + 1e-3  # never more than one step apart, first call to last
    error = [float((a - e).abs().mean()) for a, e in zip(folded, expected, strict=True)]
    unfolded_error = [float((a - e).abs().mean()) for a, e in zip(unfolded, expected, strict=True)]
    assert sum(error) <= sum(unfolded_error) * (1 + 1e-3)
    _, _, default = _rolled(model, steps[:4], contextlib.nullcontext, run=False)
    assert [d.detail for d in default] == [fold.CARRIED_STATE]


@pytest.mark.parametrize("scale", [0.3, -0.25])
def test_power_of_two_opt_in_declines_any_other_scale_at_carried_state(scale):
    from etfold.backends.arm import power_of_two_scales_fold_into_carried_state
    from etfold.backends.arm._passes import fold_scalar_mul_into_conv_pass as fold

    torch.manual_seed(0)
    steps = [(torch.randn(1, 4, 6, 6),) for _ in range(4)]
    _, _, decisions = _rolled(
        StateTimesScale(scale).eval(), steps, power_of_two_scales_fold_into_carried_state, run=False
    )
    assert [d.detail for d in decisions] == [fold.CARRIED_STATE_NOT_POWER_OF_TWO]


@pytest.mark.parametrize(
    "value,expected", [(0.25, True), (4.0, True), (1.0, True), (0.3, False), (-0.5, False)]
)
def test_positive_power_of_two(value, expected):
    from etfold.backends.arm._passes.fold_scalar_mul_into_conv_pass import (
        is_positive_power_of_two,
    )

    assert is_positive_power_of_two(torch.tensor(value)) is expected
    assert not is_positive_power_of_two(torch.tensor([0.25, 0.5]))
