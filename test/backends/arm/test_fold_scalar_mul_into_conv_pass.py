# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""FoldScalarMulIntoConvPass: conv(x, W, b) * s -> conv(x, W * s, b * s).

Lowered on TOSA-1.0+INT (folded in the annotation pipeline, before calibration)
and TOSA-1.0+FP (folded in the backend pipeline), run on tosa_reference_model,
and compared with fp32 eager, the unfolded lowering (neither upstream's fold nor
ours) and a hand-folded model (weights pre-scaled in fp32, nothing to fold).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math

import pytest
import torch
from executorch.backends.arm.constants import DISALLOW_TFA_META_KEY
from executorch.exir import to_edge

from etfold.backends.arm import FoldScalarMulIntoConvPass, arm_folds_registered
from etfold.backends.arm._passes import fold_scalar_mul_into_conv_pass as fold
from etfold.backends.arm._passes.lowering_target import lowering_for
from etfold.backends.arm.registration import upstream_folds_retired
from etfold.decisions import FoldDecision, collect_decisions
from etfold.harness.tosa_runner import (
    FP,
    INT,
    TosaProgram,
    lower_module_tosa,
    max_code_difference,
    output_scales,
)
from etfold.harness.xnnpack_runner import eager_outputs

_LOWERINGS = {
    "unfolded": upstream_folds_retired,
    "stock": contextlib.nullcontext,
    "etfold": arm_folds_registered,
}


def mine(journal: list[FoldDecision]) -> list[FoldDecision]:
    """This fold's decisions (other registered folds record theirs too)."""
    return [d for d in journal if d.fold == fold.FOLD]


def lower(model: torch.nn.Module, inputs: tuple, profile: str, how: str) -> TosaProgram:
    """Lower a private copy of `model` one of three ways."""
    with _LOWERINGS[how]():
        program, _ = lower_module_tosa(copy.deepcopy(model), inputs, profile)
    return program


def errors(program: TosaProgram, inputs: tuple, reference: torch.Tensor) -> tuple[float, float]:
    diff = (program.run(*inputs).outputs[0] - reference).abs()
    return float(diff.max()), float(diff.mean())


def no_worse(folded: float, unfolded: float) -> bool:
    """`folded` <= `unfolded`, up to fp32 noise in dequantizing (1e-5 relative)."""
    return folded <= unfolded * (1 + 1e-5)


class ConvScale(torch.nn.Module):
    """conv(x) * s, with s a Python number or a per-channel buffer [1, C, 1(, 1)]."""

    def __init__(self, dims: int, scale, cin: int = 3, cout: int = 8, scale_first: bool = False):
        super().__init__()
        conv = torch.nn.Conv1d if dims == 1 else torch.nn.Conv2d
        self.conv = conv(cin, cout, 3, padding=1)
        self.scale_first = scale_first
        if isinstance(scale, torch.Tensor):
            self.register_buffer("scale", scale.reshape(1, cout, *([1] * dims)))
        else:
            self.scale = scale

    def forward(self, x):
        return self.scale * self.conv(x) if self.scale_first else self.conv(x) * self.scale

    def hand_folded(self) -> torch.nn.Module:
        """The same conv with the scale multiplied into its fp32 weight and bias."""
        plain = copy.deepcopy(self.conv)
        scale = torch.as_tensor(self.scale, dtype=torch.float32).reshape(-1)
        scale = scale.expand(plain.out_channels)
        with torch.no_grad():
            plain.weight.mul_(scale.reshape(-1, *([1] * (plain.weight.dim() - 1))))
            plain.bias.mul_(scale)
        return plain


def _model(dims: int, kind: str, seed: int = 0) -> tuple[ConvScale, tuple]:
    torch.manual_seed(seed)
    scale = 0.75 if kind == "scalar" else torch.linspace(0.25, 2.0, 8)
    model = ConvScale(dims, scale, scale_first=kind == "scalar").eval()
    shape = (1, 3, 32) if dims == 1 else (1, 3, 8, 8)
    calibration_and_input = torch.randn(*shape)
    return model, (calibration_and_input,)


@functools.cache
def lowered_case(
    dims: int, kind: str, profile: str, how: str
) -> tuple[TosaProgram, tuple[FoldDecision, ...]]:
    """Each (model, profile, lowering) once per session; tests only read the programs."""
    model, inputs = _model(dims, kind)
    with collect_decisions() as journal:
        program = lower(model, inputs, profile, how)
    return program, tuple(mine(journal))


@functools.cache
def hand_folded_case(dims: int, kind: str) -> TosaProgram:
    model, inputs = _model(dims, kind)
    return lower_module_tosa(model.hand_folded(), inputs, INT)[0]


def _sampled(cases: list[tuple], long: set[str]) -> list:
    """`cases` as parameters named by their ids; those named in `long` run in `make test-long`."""
    return [
        pytest.param(*case[:-1], id=case[-1], marks=[pytest.mark.long] if case[-1] in long else [])
        for case in cases
    ]


# Each kind and each conv rank in `make test`; the other two pairings in `make test-long`.
KIND_AND_DIMS = [
    (kind, dims, f"{kind}-conv{dims}d") for kind in ("scalar", "per_channel") for dims in (1, 2)
]
KIND_AND_DIMS_LONG = {"scalar-conv1d", "per_channel-conv2d"}


@pytest.mark.parametrize("kind, dims", _sampled(KIND_AND_DIMS, KIND_AND_DIMS_LONG))
def test_int_fold_removes_mul_and_matches_hand_folded(dims, kind):
    model, inputs = _model(dims, kind)
    unfolded, _ = lowered_case(dims, kind, INT, "unfolded")
    folded, decisions = lowered_case(dims, kind, INT, "etfold")
    hand = hand_folded_case(dims, kind)

    assert unfolded.operator_counts()["MUL"] == 1
    assert folded.operator_counts()["MUL"] == 0
    assert sum(folded.operator_counts().values()) < sum(unfolded.operator_counts().values())
    assert folded.operator_counts() == hand.operator_counts()
    assert [(d.applied, d.where.split(":")[0]) for d in decisions] == [(True, "annotation")]

    lsb = output_scales(folded)[0]
    folded_out = folded.run(*inputs).outputs[0]
    assert float((folded_out - hand.run(*inputs).outputs[0]).abs().max()) <= lsb * 1.001

    reference = eager_outputs(model, inputs)[0]
    folded_max, folded_mean = errors(folded, inputs, reference)
    unfolded_max, unfolded_mean = errors(unfolded, inputs, reference)
    assert no_worse(folded_max, unfolded_max)
    assert no_worse(folded_mean, unfolded_mean)


def test_stock_never_folds_conv1d():
    stock, _ = lowered_case(1, "scalar", INT, "stock")
    assert stock.operator_counts()["MUL"] == 1


def test_conv2d_3_to_8_operator_count_drops_like_stock():
    stock = lowered_case(2, "scalar", INT, "stock")[0].operator_counts()
    folded = lowered_case(2, "scalar", INT, "etfold")[0].operator_counts()
    unfolded = lowered_case(2, "scalar", INT, "unfolded")[0].operator_counts()
    assert folded == stock
    assert sum(folded.values()) < sum(unfolded.values())
    assert (unfolded["MUL"], folded["MUL"]) == (1, 0)


@pytest.mark.parametrize("kind, dims", _sampled(KIND_AND_DIMS, KIND_AND_DIMS_LONG))
def test_fp_fold_in_backend_pipeline(dims, kind):
    model, inputs = _model(dims, kind)
    folded, decisions = lowered_case(dims, kind, FP, "etfold")
    assert folded.operator_counts()["MUL"] == 0
    assert [(d.applied, d.where.split(":")[0]) for d in decisions] == [(True, "backend")]
    reference = eager_outputs(model, inputs)[0]
    torch.testing.assert_close(folded.run(*inputs).outputs[0], reference, atol=1e-5, rtol=1e-5)


def test_wide_dynamic_range_per_channel_scale_is_no_worse_than_unfolded():
    """Upstream keeps this case (logspace scales) as an expected failure."""
    torch.manual_seed(1)
    model = ConvScale(2, torch.logspace(-3, 2, 8)).eval()
    inputs = (torch.randn(1, 3, 8, 8),)
    calibration = [(torch.randn(1, 3, 8, 8),) for _ in range(3)]
    with arm_folds_registered(), collect_decisions() as journal:
        folded, reference = lower_module_tosa(
            copy.deepcopy(model), inputs, INT, calibration=calibration
        )
    with upstream_folds_retired():
        unfolded, _ = lower_module_tosa(copy.deepcopy(model), inputs, INT, calibration=calibration)
    assert [d.applied for d in mine(journal)] == [True]
    assert folded.operator_counts()["MUL"] == 0
    folded_max, folded_mean = errors(folded, inputs, reference[0])
    unfolded_max, unfolded_mean = errors(unfolded, inputs, reference[0])
    assert no_worse(folded_max, unfolded_max)
    assert no_worse(folded_mean, unfolded_mean)


class SharedWeight(torch.nn.Module):
    """Two convs reading one weight, scaled differently and then added (or subtracted);
    the second reads `x` mirrored, or, with `twin`, `x` itself (one product twice)."""

    def __init__(self, twin: bool = False, scales=(2.0, 5.0), subtract: bool = False):
        super().__init__()
        self.twin, self.scales, self.subtract = twin, scales, subtract
        self.a = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.b = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.b.weight = self.a.weight

    def second_input(self, x):
        return x if self.twin else x.flip(-1)

    def combine(self, left, right):
        return left - right if self.subtract else left + right

    def forward(self, x):
        left, right = self.a(x), self.b(self.second_input(x))
        if self.scales is not None:
            left, right = left * self.scales[0], right * self.scales[1]
        return self.combine(left, right)

    def hand_folded(self) -> torch.nn.Module:
        """The same model with each scale multiplied into its own fp32 copy of the weight."""
        folded = copy.deepcopy(self)
        folded.b.weight = torch.nn.Parameter(self.a.weight.detach().clone())
        with torch.no_grad():
            for conv, s in zip((folded.a, folded.b), self.scales, strict=True):
                conv.weight.mul_(s)
                conv.bias.mul_(s)
        folded.scales = None
        return folded.eval()


def _shared(**kwargs):
    torch.manual_seed(0)
    return SharedWeight(**kwargs).eval(), (torch.randn(1, 3, 8, 8),)


@pytest.mark.parametrize(
    "profile, twin",
    _sampled(
        [
            (p, twin, f"{p}-{name}")
            for p in (INT, FP)
            for twin, name in ((False, "mirrored_input"), (True, "twin"))
        ],
        {f"{INT}-mirrored_input", f"{FP}-twin"},
    ),
)
def test_shared_weight_folds_each_conv_with_its_own_scale(profile, twin):
    """Twins whose scaled products are summed with same-sign scales fold too: their
    shared rounding adds up, it does not cancel."""
    model, inputs = _shared(twin=twin)
    with collect_decisions() as journal:
        folded = lower(model, inputs, profile, "etfold")
    assert folded.operator_counts()["MUL"] == 0
    assert sum(d.applied for d in mine(journal)) == 2
    new_weights = {d.detail.rsplit("-> ", 1)[1] for d in mine(journal)}
    assert len(new_weights) == 2  # two fresh constants, not one reused
    out = folded.run(*inputs).outputs[0]
    if profile == INT:
        hand, _ = lower_module_tosa(model.hand_folded(), inputs, profile)
        expected = hand.run(*inputs).outputs[0]
        assert float((out - expected).abs().max()) <= output_scales(folded)[0] * 1.001
    else:
        torch.testing.assert_close(out, eager_outputs(model, inputs)[0], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    "scales, subtract",
    [
        # the same cancellation reached by a sum: `make test-long`
        pytest.param((2.0, -5.0), False, marks=pytest.mark.long),
        ((2.0, 5.0), True),
    ],
    ids=["opposite_signs_added", "same_signs_subtracted"],
)
def test_twins_whose_products_cancel_keep_their_scales_before_calibration(scales, subtract):
    """Quantized, a conv computed twice rounds alike in both places (one weight rounding,
    the same output codes); where the two scaled products cancel, so does that rounding,
    and folding a scale into each would round each on its own. INT declines both and
    matches the unfolded lowering code for code."""
    model, inputs = _shared(twin=True, scales=scales, subtract=subtract)
    with collect_decisions() as journal:
        folded = lower(model, inputs, INT, "etfold")
    assert {d.detail for d in mine(journal) if not d.applied} == {fold.TWIN_BEFORE_CALIBRATION}
    assert not any(d.applied for d in mine(journal))
    unfolded = lower(model, inputs, INT, "unfolded")
    assert max_code_difference(folded.run(*inputs), unfolded.run(*inputs)) == 0


def test_cancelling_twins_fold_exactly_in_float():
    model, inputs = _shared(twin=True, scales=(2.0, -5.0))
    with collect_decisions() as journal:
        folded = lower(model, inputs, FP, "etfold")
    assert sum(d.applied for d in mine(journal)) == 2
    torch.testing.assert_close(
        folded.run(*inputs).outputs[0], eager_outputs(model, inputs)[0], atol=1e-4, rtol=1e-5
    )


class TwinsApart(torch.nn.Module):
    """Two conv1d's on one input and one weight, each scaled by its own factor and
    returned apart (or, with `meet`, concatenated and summed over channels)."""

    def __init__(self, scales, meet: bool = False):
        super().__init__()
        self.scales, self.meet = scales, meet
        self.a = torch.nn.Conv1d(3, 8, 3, padding=1)
        self.b = torch.nn.Conv1d(3, 8, 3, padding=1)
        self.b.weight = self.a.weight

    def forward(self, x):
        left, right = self.a(x), self.b(x)
        if self.scales is not None:
            left, right = left * self.scales[0], right * self.scales[1]
        return torch.cat([left, right], 1).sum(1) if self.meet else (left, right)

    def hand_folded(self) -> torch.nn.Module:
        folded = copy.deepcopy(self)
        folded.b.weight = torch.nn.Parameter(self.a.weight.detach().clone())
        with torch.no_grad():
            for conv, s in zip((folded.a, folded.b), self.scales, strict=True):
                conv.weight.mul_(s.reshape(-1, 1, 1) if torch.is_tensor(s) else s)
                conv.bias.mul_(s.reshape(-1) if torch.is_tensor(s) else s)
        folded.scales = None
        return folded.eval()


_APART_SCALES = {
    "scalar": (0.5, -3.0),
    "per_channel": (torch.linspace(0.5, 2.0, 8).reshape(1, 8, 1), -0.75),
}


@pytest.mark.parametrize(
    "profile, scales",
    _sampled(
        [(p, scales, f"{p}-{scales}") for p in (INT, FP) for scales in _APART_SCALES],
        {f"{INT}-scalar", f"{FP}-per_channel"},
    ),
)
def test_twins_returned_apart_both_fold_within_one_lsb_of_hand_folded(profile, scales):
    """Their results never meet, so no sum can cancel the rounding they share."""
    torch.manual_seed(0)
    model, inputs = TwinsApart(_APART_SCALES[scales]).eval(), (torch.randn(1, 3, 16),)
    with collect_decisions() as journal:
        folded = lower(model, inputs, profile, "etfold")
    assert [d.applied for d in mine(journal)] == [True, True]
    assert folded.operator_counts()["MUL"] == 0
    hand, _ = lower_module_tosa(model.hand_folded(), inputs, profile)
    outs, expected = folded.run(*inputs).outputs, hand.run(*inputs).outputs
    for out, want, lsb in zip(outs, expected, output_scales(hand), strict=True):
        tolerance = lsb * 1.001 if profile == INT else 1e-5
        assert float((out - want).abs().max()) <= tolerance


def test_twins_whose_results_meet_past_an_add_keep_their_scales_before_calibration():
    model = TwinsApart((2.0, -2.0), meet=True).eval()
    graph_module = torch.export.export(model, (torch.randn(1, 3, 16),)).module(check_guards=False)
    before = str(graph_module.graph)
    with collect_decisions() as journal:
        assert not FoldScalarMulIntoConvPass(tfa_pass=True)(graph_module).modified
    assert str(graph_module.graph) == before
    assert [d.detail for d in mine(journal)] == [fold.TWIN_BEFORE_CALIBRATION] * 2


def test_stock_gets_shared_weight_wrong_on_fp():
    """Documents the upstream bug: the second conv reads the weight already scaled by the first."""
    model, inputs = _shared(twin=True)
    stock = lower(model, inputs, FP, "stock")
    error = float((stock.run(*inputs).outputs[0] - eager_outputs(model, inputs)[0]).abs().max())
    assert error > 1.0


@pytest.mark.parametrize("profile", [INT, FP])
def test_user_module_is_untouched_and_lowering_twice_is_stable(profile):
    model, inputs = _model(2, "per_channel")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eager_before = eager_outputs(model, inputs)[0]
    with arm_folds_registered():
        first, _ = lower_module_tosa(model, inputs, profile)
        second, _ = lower_module_tosa(model, inputs, profile)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    torch.testing.assert_close(eager_outputs(model, inputs)[0], eager_before, atol=0, rtol=0)
    assert torch.equal(first.run(*inputs).outputs[0], second.run(*inputs).outputs[0])


def test_stock_writes_into_the_user_module():
    """Documents the upstream bug the fresh-constant rule prevents."""
    model, inputs = _model(2, "per_channel")
    before = model.conv.weight.detach().clone()
    lower_module_tosa(model, inputs, INT)
    assert not torch.equal(model.conv.weight, before)


class TransposedScale(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.conv = torch.nn.ConvTranspose2d(4, 6, 3, groups=groups)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 6).reshape(1, 6, 1, 1))

    def forward(self, x):
        return self.conv(x) * self.scale


def _quantized_for_u85():
    """Quantize as for an Ethos-U85, which fuses a transposed conv's per-channel
    requantization: there a scale that differs between channels folds before calibration."""
    from executorch.backends.arm.ethosu import EthosUCompileSpec

    return lowering_for(EthosUCompileSpec("ethos-u85-256"))


@pytest.mark.parametrize("profile", [INT, FP])
def test_transposed_conv_folds_along_its_output_channel_axis(profile):
    torch.manual_seed(0)
    model, inputs = TransposedScale(groups=1).eval(), (torch.randn(1, 4, 6, 6),)
    target = _quantized_for_u85() if profile == INT else contextlib.nullcontext()
    with collect_decisions() as journal, target:
        folded = lower(model, inputs, profile, "etfold")
    assert [d.applied for d in mine(journal)] == [True]
    assert folded.operator_counts()["MUL"] == 0
    assert folded.operator_counts()["TRANSPOSE_CONV2D"] == 1
    reference = eager_outputs(model, inputs)[0]
    if profile == FP:
        torch.testing.assert_close(folded.run(*inputs).outputs[0], reference, atol=1e-5, rtol=1e-5)
    else:
        unfolded = lower(model, inputs, profile, "unfolded")
        assert no_worse(
            errors(folded, inputs, reference)[0], errors(unfolded, inputs, reference)[0]
        )


@pytest.mark.parametrize(
    "make",
    [
        lambda: TransposedScale(groups=2),
        lambda: ConvScale(2, torch.linspace(0.5, 2.0, 8), cin=4, cout=8),
    ],
    ids=["grouped_transposed", "grouped"],
)
def test_grouped_convs_fold_exactly_on_the_aten_graph(make):
    """Grouped weights put out-channels on a different axis for transposed convs."""
    torch.manual_seed(0)
    model = make().eval()
    if isinstance(model, ConvScale):
        model.conv = torch.nn.Conv2d(4, 8, 3, groups=2)
    inputs = (torch.randn(1, 4, 6, 6),)
    graph_module = torch.export.export(model, inputs).module(check_guards=False)
    with collect_decisions() as journal, _quantized_for_u85():
        FoldScalarMulIntoConvPass(tfa_pass=True)(graph_module)
    assert [d.applied for d in mine(journal)] == [True]
    assert not _muls(graph_module)
    torch.testing.assert_close(graph_module(*inputs), model(*inputs), atol=1e-5, rtol=1e-5)


def test_uneven_scale_into_a_transposed_conv_declines_before_calibration_for_no_named_npu():
    """A TOSA quantizer names no NPU, and its program may go to Vela for a U55."""
    torch.manual_seed(0)
    graph_module = torch.export.export(
        TransposedScale(groups=1).eval(), (torch.randn(1, 4, 6, 6),)
    ).module(check_guards=False)
    before = graph_module.code
    with collect_decisions() as journal:
        FoldScalarMulIntoConvPass(tfa_pass=True)(graph_module)
    [decision] = mine(journal)
    assert not decision.applied and graph_module.code == before
    assert decision.detail.startswith("quantizing with no Ethos-U target named")


# ---- graph level: fresh constants, deterministic names, deletion only when unused ----


def _muls(graph_module) -> list:
    return [
        n for n in graph_module.graph.nodes if n.op == "call_function" and "mul" in str(n.target)
    ]


def test_annotation_form_creates_fresh_attributes_and_never_writes_the_source():
    model, inputs = _model(2, "per_channel")
    graph_module = torch.export.export(model, inputs).module(check_guards=False)
    source = graph_module.conv.weight
    source_values = source.detach().clone()
    FoldScalarMulIntoConvPass(tfa_pass=True)(graph_module)
    conv = next(
        n for n in graph_module.graph.nodes if n.op == "call_function" and "conv" in str(n.target)
    )
    weight_name, bias_name = conv.args[1].target, conv.args[2].target
    digest = fold.tensor_digest(model.scale.reshape(-1).float(), fold.NAME_DIGEST_LENGTH)
    assert (weight_name, bias_name) == (f"conv_weight_mul_{digest}", f"conv_bias_mul_{digest}")
    assert torch.equal(source, source_values) and torch.equal(model.conv.weight, source_values)
    assert not hasattr(
        graph_module.conv, "weight"
    )  # unused now, dropped from the export-made container
    assert not any(n.op == "get_attr" and n.target == "scale" for n in graph_module.graph.nodes)
    torch.testing.assert_close(graph_module(*inputs), model(*inputs), atol=1e-5, rtol=1e-5)


def test_backend_form_creates_fresh_placeholders_and_keeps_a_source_still_read():
    class ScaledAndPlain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.b = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.a(x) * 3.0, self.b(x)

    torch.manual_seed(0)
    model, inputs = ScaledAndPlain().eval(), (torch.randn(1, 3, 8, 8),)
    program = to_edge(torch.export.export(model, inputs)).exported_program()
    shared = next(n for n in program.graph.nodes if n.op == "placeholder" and len(n.users) == 2)
    shared_name, shared_target = (
        shared.name,
        program.graph_signature.inputs_to_parameters[shared.name],
    )
    FoldScalarMulIntoConvPass(program)(program.graph_module)
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    assert (
        shared_name in placeholders and len(placeholders[shared_name].users) == 1
    )  # b still reads it
    created = [
        n
        for n in placeholders
        if n.endswith(fold.tensor_digest(torch.full((8,), 3.0), fold.NAME_DIGEST_LENGTH))
    ]
    assert len(created) == 2  # weight and bias
    assert all(name in program.state_dict for name in created)
    assert program.state_dict[shared_target] is not None
    assert torch.equal(program.state_dict[shared_target], model.a.weight)
    out = program.module()(*inputs)
    torch.testing.assert_close(out[0], model(*inputs)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], model(*inputs)[1], atol=0, rtol=0)


# ---- declines: one per predicate, graph unchanged and reason recorded ----


class ConvThen(torch.nn.Module):
    """A conv followed by `tail(self, conv_out, *extra)`; the knobs build each decline case."""

    def __init__(self, tail, scale=None, weight_from_input=False, bias_from_input=False):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.tail = tail
        self.weight_from_input = weight_from_input
        self.bias_from_input = bias_from_input
        if scale is not None:
            self.register_buffer("scale", scale)

    def forward(self, x, extra):
        weight = self.conv.weight * extra.mean() if self.weight_from_input else self.conv.weight
        bias = self.conv.bias + extra.mean() if self.bias_from_input else self.conv.bias
        return self.tail(self, torch.nn.functional.conv2d(x, weight, bias, padding=1), extra)


def _declines(model: torch.nn.Module, edit=None) -> str:
    torch.manual_seed(0)
    inputs = (torch.randn(1, 3, 6, 6), torch.randn(1, 4, 6, 6))
    graph_module = torch.export.export(model.eval(), inputs).module(check_guards=False)
    if edit is not None:
        edit(graph_module)
    before = str(graph_module.graph)
    attributes = sorted(n for n, _ in graph_module.named_buffers()) + sorted(
        n for n, _ in graph_module.named_parameters()
    )
    with collect_decisions() as journal:
        result = FoldScalarMulIntoConvPass(tfa_pass=True)(graph_module)
    assert not result.modified
    assert str(graph_module.graph) == before
    after = sorted(n for n, _ in graph_module.named_buffers()) + sorted(
        n for n, _ in graph_module.named_parameters()
    )
    assert after == attributes
    assert len(mine(journal)) == 1 and not mine(journal)[0].applied
    return mine(journal)[0].detail


def _first(graph_module, word):
    return next(
        n for n in graph_module.graph.nodes if n.op == "call_function" and word in str(n.target)
    )


def test_declines_when_conv_output_has_several_users():
    model = ConvThen(lambda self, y, e: y * 2.0 + y)
    assert _declines(model) == fold.SEVERAL_USERS


def test_declines_when_scale_is_not_constant():
    model = ConvThen(lambda self, y, e: y * e)
    assert _declines(model) == fold.SCALE_NOT_CONSTANT


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_declines_when_scale_is_not_finite(value):
    model = ConvThen(
        lambda self, y, e: y * self.scale,
        scale=torch.tensor([1.0, value, 1.0, 1.0]).reshape(1, 4, 1, 1),
    )
    assert _declines(model) == fold.SCALE_NOT_FINITE


def test_declines_when_scale_broadcasts_along_a_non_channel_dim():
    model = ConvThen(
        lambda self, y, e: y * self.scale, scale=torch.linspace(0.5, 1.5, 6).reshape(1, 1, 6, 1)
    )
    assert _declines(model) == fold.SCALE_NOT_CHANNELWISE


def test_declines_when_the_mul_changes_the_output_dtype():
    scale = torch.linspace(0.5, 1.5, 4, dtype=torch.float64).reshape(1, 4, 1, 1)
    model = ConvThen(lambda self, y, e: y * self.scale, scale=scale)
    assert _declines(model) == fold.CHANGES_OUTPUT


def test_declines_when_conv_weight_is_not_constant():
    model = ConvThen(lambda self, y, e: y * 2.0, weight_from_input=True)
    assert _declines(model) == fold.WEIGHT_NOT_CONSTANT


def test_declines_when_conv_bias_is_not_constant():
    model = ConvThen(lambda self, y, e: y * 2.0, bias_from_input=True)
    assert _declines(model) == fold.BIAS_NOT_CONSTANT


def test_declines_when_conv_output_reaches_carried_state():
    class WritesBack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.register_buffer("state", torch.zeros(1, 4, 6, 6))

        def forward(self, x, extra):
            y = self.conv(x) * 2.0  # the multiply rounds the written-back state
            self.state.copy_(y)
            return y + extra

    assert _declines(WritesBack()) == fold.CARRIED_STATE


def test_declines_when_node_is_marked_not_to_transform():
    def disallow(graph_module):
        _first(graph_module, "mul").meta[DISALLOW_TFA_META_KEY] = True

    assert _declines(ConvThen(lambda self, y, e: y * 2.0), disallow) == fold.DISALLOWED


def test_declines_when_conv_or_mul_has_no_shape_metadata():
    def drop_shape(graph_module):
        del _first(graph_module, "conv").meta["val"]

    assert _declines(ConvThen(lambda self, y, e: y * 2.0), drop_shape) == fold.NO_SHAPE


def test_declines_when_conv_is_already_quantized():
    def annotate(graph_module):
        conv = _first(graph_module, "conv")
        conv.meta["input_qparams"] = {0: object()}
        conv.meta["output_qparams"] = {0: object()}

    assert _declines(ConvThen(lambda self, y, e: y * 2.0), annotate) == fold.QUANTIZED


def test_declines_when_folding_shrinks_weights_below_the_int8_scale_floor():
    model = ConvThen(
        lambda self, y, e: y * self.scale,
        scale=torch.tensor([1e-3, 2e-3, 1.5e-3, 1e-3]).reshape(1, 4, 1, 1),
    )
    assert _declines(model) == fold.WEIGHT_BELOW_SCALE_FLOOR


def test_tiny_per_channel_scales_stay_as_accurate_as_unfolded_in_int8():
    torch.manual_seed(3)
    scale = torch.linspace(1e-3, 2e-3, 8)
    model = ConvScale(2, scale).eval()
    inputs = (torch.randn(1, 3, 6, 6),)
    reference = eager_outputs(model, inputs)[0]
    with collect_decisions() as journal:
        ours = lower(model, inputs, INT, "etfold")
    unfolded = lower(model, inputs, INT, "unfolded")
    (lsb,) = output_scales(ours)[-1:]
    assert [d.detail for d in mine(journal)] == [fold.WEIGHT_BELOW_SCALE_FLOOR]
    ours_max, ours_mean = errors(ours, inputs, reference)
    unfolded_max, unfolded_mean = errors(unfolded, inputs, reference)
    assert ours_max <= unfolded_max + lsb and no_worse(ours_mean, unfolded_mean)


@pytest.mark.parametrize("transposed", [False, True])
def test_weight_floor_guard_reads_output_channels_on_the_right_axis(transposed):
    """Small weights everywhere but output channel 4's: shrinking channel 4 is fine,
    shrinking channel 3 as much pushes it below the int8 scale floor."""
    groups, cin, cout = 2, 4, 6
    shape = (cin, cout // groups, 3, 3) if transposed else (cout, cin // groups, 3, 3)
    weight = torch.full(shape, 2e-3)
    if transposed:  # output channel 4 = group 1, channel 1 within the group
        weight[cin // groups :, 1] = 0.05
    else:
        weight[4] = 0.05
    scale = torch.ones(cout)
    scale[4] = 0.05
    assert fold.keeps_weight_precision(weight, scale, transposed, groups)
    scale[3] = 0.05
    assert not fold.keeps_weight_precision(weight, scale, transposed, groups)
    scale[3] = 0.0  # exact zeros lose nothing
    assert fold.keeps_weight_precision(weight, scale, transposed, groups)
