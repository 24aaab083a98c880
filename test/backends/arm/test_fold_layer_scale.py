# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""LayerScale: a scale after a linear or conv, through layout ops and inference no-ops.

    L(layer(x, W, b)) * s -> L(layer(x, W * s, b * s))

Graph level: the pass on the exported ATen graph (as the annotation pipeline
sees it) removes the multiply and matches eager in fp32. Runtime: the report's
ConvNeXt and ViT blocks on TOSA-1.0+INT, etfold against the unfolded lowering
on the reference model, and the user's module untouched.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.arm import FoldScalarMulIntoConvPass, arm_folds_registered
from etfold.backends.arm._passes import fold_scalar_mul_into_conv_pass as fold
from etfold.backends.arm.registration import upstream_folds_retired
from etfold.decisions import collect_decisions
from etfold.demo_models.arm_npu_blocks import CONVNEXT, VIT
from etfold.harness.tosa_runner import (
    INT,
    lower_module_tosa,
    max_code_difference,
    output_scales,
)


def mine(journal):
    return [d for d in journal if d.fold == fold.FOLD]


class Scaled(torch.nn.Module):
    """layer -> tail -> * gamma, with gamma along the layer's output channels."""

    def __init__(self, layer: torch.nn.Module, tail, gamma_shape, channels: int = 6):
        super().__init__()
        self.layer = layer
        self.tail = tail
        self.gamma = torch.nn.Parameter(torch.linspace(0.25, 1.75, channels).reshape(gamma_shape))

    def forward(self, x):
        return self.tail(self.layer(x)) * self.gamma


def _fold(module, x):
    graph_module = torch.export.export(module.eval(), (x,)).module(check_guards=False)
    before = str(graph_module.graph)
    with collect_decisions() as journal:
        result = FoldScalarMulIntoConvPass(tfa_pass=True)(graph_module)
    return graph_module, before, result, mine(journal)


def _muls(graph_module) -> int:
    return sum(
        1 for n in graph_module.graph.nodes if n.op == "call_function" and "mul" in str(n.target)
    )


_SITES = {
    "linear": (lambda: torch.nn.Linear(4, 6), lambda y: y, (6,), (2, 5, 4)),
    "linear_dropout0": (
        lambda: torch.nn.Linear(4, 6),
        torch.nn.Dropout(0.0),
        (6,),
        (2, 5, 4),
    ),
    "linear_eval_dropout": (
        lambda: torch.nn.Linear(4, 6),
        torch.nn.Dropout(0.3),
        (6,),
        (2, 5, 4),
    ),
    "linear_clone": (lambda: torch.nn.Linear(4, 6), lambda y: y.clone(), (6,), (2, 5, 4)),
    "linear_no_bias_reshape": (
        lambda: torch.nn.Linear(4, 6, bias=False),
        lambda y: y.reshape(10, 6),
        (6,),
        (2, 5, 4),
    ),
    "conv_permute_channels_last": (
        lambda: torch.nn.Conv2d(3, 6, 3, padding=1),
        lambda y: y.permute(0, 2, 3, 1),
        (6,),
        (1, 3, 5, 5),
    ),
    "conv_flatten_transpose_vit_patches": (
        lambda: torch.nn.Conv2d(3, 6, 2, stride=2),
        lambda y: y.flatten(2).transpose(1, 2),
        (6,),
        (1, 3, 8, 8),
    ),
    "linear_permute_back_to_nchw": (
        lambda: torch.nn.Linear(4, 6),
        lambda y: y.permute(0, 3, 1, 2),
        (1, 6, 1, 1),
        (1, 3, 3, 4),
    ),
}


@pytest.mark.parametrize("site", list(_SITES))
def test_fold_removes_the_multiply_and_is_exact_in_fp32(site):
    make, tail, gamma_shape, shape = _SITES[site]
    torch.manual_seed(0)
    module = Scaled(make(), tail, gamma_shape).eval()
    x = torch.randn(*shape)
    graph_module, _, result, decisions = _fold(module, x)
    assert result.modified
    assert [d.applied for d in decisions] == [True]
    assert _muls(graph_module) == 0
    torch.testing.assert_close(graph_module(x), module(x), atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    scalar=st.booleans(),
    values=st.lists(
        st.floats(-4, 4, allow_nan=False).filter(lambda v: abs(v) > 1e-3), min_size=6, max_size=6
    ),
    bias=st.booleans(),
)
def test_linear_fold_is_exact_for_generated_scales(scalar, values, bias):
    torch.manual_seed(1)
    module = Scaled(torch.nn.Linear(4, 6, bias=bias), torch.nn.Dropout(0.0), (6,)).eval()
    with torch.no_grad():
        module.gamma.copy_(torch.tensor(values[:1] * 6 if scalar else values))
    x = torch.randn(3, 4)
    graph_module, before, result, decisions = _fold(module, x)
    if not result.modified:  # a scale small enough to push a channel below int8's floor
        assert [d.detail for d in decisions] == [fold.WEIGHT_BELOW_SCALE_FLOOR]
        assert str(graph_module.graph) == before
        return
    assert _muls(graph_module) == 0
    torch.testing.assert_close(graph_module(x), module(x), atol=1e-5, rtol=1e-4)


# ---- declines: graph unchanged, reason recorded ----


def _declines(module, x) -> str:
    graph_module, before, result, decisions = _fold(module, x)
    assert not result.modified
    assert str(graph_module.graph) == before
    assert len(decisions) == 1 and not decisions[0].applied
    return decisions[0].detail


def test_declines_when_a_node_between_layer_and_scale_has_several_users():
    class Branches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 6)

        def forward(self, x):
            y = self.fc(x).permute(1, 0)
            return y * 2.0, y

    assert _declines(Branches(), torch.randn(3, 4)) == fold.SEVERAL_USERS


def test_declines_when_a_reshape_mixes_the_channel_axis():
    module = Scaled(torch.nn.Linear(4, 6), lambda y: y.reshape(2, 5, 3, 2), (2,), 2)
    assert _declines(module, torch.randn(2, 5, 4)) == fold.CHANNELS_MIXED


def test_declines_when_the_scale_runs_along_tokens_after_a_permute():
    module = Scaled(torch.nn.Linear(4, 6), lambda y: y.permute(0, 2, 1), (5,), channels=5)
    assert _declines(module, torch.randn(2, 5, 4)) == fold.SCALE_NOT_CHANNELWISE


def test_training_dropout_is_not_a_site():
    class TrainDropout(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 6)

        def forward(self, x):
            return torch.nn.functional.dropout(self.fc(x), 0.5, training=True) * 2.0

    graph_module, before, result, decisions = _fold(TrainDropout(), torch.randn(3, 4))
    assert not result.modified and decisions == [] and str(graph_module.graph) == before


def test_declines_when_the_layer_is_left_unquantized_conv_transpose1d():
    """The Arm quantizer has no pattern for conv_transpose1d: it stays float, outside the delegate."""

    class ConvTranspose1dScale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.ConvTranspose1d(4, 6, 3, stride=2)
            self.register_buffer("s", torch.linspace(0.5, 2.0, 6).reshape(1, 6, 1))

        def forward(self, x):
            return self.up(x) * self.s

    torch.manual_seed(0)
    model, x = ConvTranspose1dScale().eval(), torch.randn(1, 4, 6)
    with arm_folds_registered(), collect_decisions() as journal:
        program, _ = lower_module_tosa(copy.deepcopy(model), (x,), INT)
    (decision,) = mine(journal)
    assert not decision.applied
    assert decision.detail == fold.NOT_QUANTIZED_LAYER.format(op="conv_transpose1d")
    assert program.operator_counts()["MUL"] == 1


# ---- the report's blocks on the TOSA reference model ----


@functools.cache
def _lowered(which: str, how: str):
    """The block lowered (the built module itself, not a copy), its decisions, and the
    module with its state from before the lowering, for the user-module check."""
    build, calibration = {"convnext": CONVNEXT, "vit": VIT}[which]
    module, inputs = build()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    context = arm_folds_registered if how == "etfold" else upstream_folds_retired
    with context(), collect_decisions() as journal:
        program, _ = lower_module_tosa(module, inputs, calibration=calibration())
    return program, tuple(journal), module, before


# applied folds per block: LayerScale into fc2 (and the attention projection);
# in the ViT also DyT's gamma/beta into qkv and fc1, and alpha into the tanh TABLE
_APPLIED = {
    "convnext": {fold.FOLD: 1},
    "vit": {fold.FOLD: 2, "arm.dyt_affine_into_conv_float": 2, "arm.dyt_alpha_into_lut": 2},
}


# The ViT block (its DyT folds are proven on their own in test_fold_dyt_*) in `make test-long`.
@pytest.mark.parametrize("which", ["convnext", pytest.param("vit", marks=pytest.mark.long)])
def test_layer_scale_blocks_lose_their_multiplies_within_one_lsb_of_unfolded(which):
    build, _ = {"convnext": CONVNEXT, "vit": VIT}[which]
    module, inputs = build()
    folded, journal, _, _ = _lowered(which, "etfold")
    unfolded, *_ = _lowered(which, "unfolded")
    applied = {}
    for decision in journal:
        applied[decision.fold] = applied.get(decision.fold, 0) + decision.applied
    assert {k: v for k, v in applied.items() if v} == _APPLIED[which]
    removed = sum(_APPLIED[which].values())  # each fold removes one multiply
    assert folded.operator_counts()["MUL"] == unfolded.operator_counts()["MUL"] - removed
    generator = torch.Generator().manual_seed(3)
    lsb = output_scales(unfolded)[0]
    for _ in range(3):
        x = torch.randn(inputs[0].shape, generator=generator)
        difference = (folded.run(x).outputs[0] - unfolded.run(x).outputs[0]).abs().max()
        assert float(difference) <= lsb * 1.001, float(difference) / lsb


def test_user_module_is_untouched():
    *_, module, before = _lowered("convnext", "etfold")  # lowered with the folds registered
    assert module.state_dict().keys() == before.keys()
    for name, value in module.state_dict().items():
        assert torch.equal(value, before[name]), name


# ---- a DyT alpha right after a conv and a permute ----


class ConvThenDyTAlpha(torch.nn.Module):
    """conv -> NHWC permute -> tanh(alpha * y): alpha is a scalar scale on the conv's
    output, through a layout op, so the scalar-mul fold reaches it before calibration."""

    def __init__(self, alpha: float):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 1)
        self.alpha = torch.nn.Parameter(torch.tensor([alpha]))

    def forward(self, x):
        return torch.tanh(self.alpha * self.conv(x).permute(0, 2, 3, 1))


class Alphas(torch.nn.Module):
    """One `ConvThenDyTAlpha` site per alpha, all reading the same input."""

    def __init__(self, alphas):
        super().__init__()
        self.sites = torch.nn.ModuleList(ConvThenDyTAlpha(alpha) for alpha in alphas)

    def forward(self, x):
        return tuple(site(x) for site in self.sites)


def test_dyt_alpha_after_a_conv_folds_into_the_conv_leaving_the_tanh_table():
    """Where upstream's alpha-into-TABLE fold would take alpha, etfold's scalar-mul fold
    takes it first (into the conv weight, before calibration): the same TOSA ops as
    alpha in the TABLE (one conv, one TABLE, no MUL per site) and the unfolded
    lowering's codes, for alpha 0.5 and 1.7 (two sites of one program)."""
    torch.manual_seed(0)
    module = Alphas([0.5, 1.7]).eval()
    generator = torch.Generator().manual_seed(1)
    calibration = [(torch.randn(1, 3, 6, 6, generator=generator),) for _ in range(3)]
    with arm_folds_registered(), collect_decisions() as journal:
        folded, _ = lower_module_tosa(
            copy.deepcopy(module), calibration[0], calibration=calibration
        )
    with upstream_folds_retired():
        unfolded, _ = lower_module_tosa(
            copy.deepcopy(module), calibration[0], calibration=calibration
        )
    assert [(d.fold, d.applied) for d in journal] == [(fold.FOLD, True)] * 2
    counts = folded.operator_counts()
    assert (counts["CONV2D"], counts["TABLE"], counts["MUL"]) == (2, 2, 0)
    assert unfolded.operator_counts()["MUL"] == 2
    for _ in range(3):
        x = torch.randn(1, 3, 6, 6, generator=generator)
        folded_run, unfolded_run = folded.run(x), unfolded.run(x)
        assert len(folded_run.codes) == len(unfolded_run.codes) == 2  # both sites' codes
        assert max_code_difference(folded_run, unfolded_run) <= 1


def test_a_bitcast_view_is_no_layout_op_and_the_scale_stays():
    """`view(dtype)` shares `view`'s name but reinterprets bits: a scale after it is not a
    scale of the conv's output, so there is no site (the graph and its values unchanged)."""

    class Bitcast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 1)

        def forward(self, x):
            return self.conv(x).view(torch.int32) * 2

    torch.manual_seed(0)
    module, x = Bitcast().eval(), torch.randn(1, 3, 4, 4)
    graph_module, before, result, decisions = _fold(module, x)
    assert not result.modified and decisions == [] and str(graph_module.graph) == before
    assert torch.equal(graph_module(x), module(x))
