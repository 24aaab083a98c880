# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""FoldDyTAffineIntoConvPass on TOSA INT: gamma/beta into the next conv, bit-identical codes."""

import copy
import functools

import pytest
import torch
from executorch.backends.arm._passes.insert_table_ops import InsertTableOpsPass
from executorch.exir.dialects._ops import ops as exir_ops

from etfold.backends.arm._passes.fold_dyt_affine_into_conv_pass import (
    FOLD,
    FoldDyTAffineIntoConvPass,
)
from etfold.backends.arm._passes.fold_dyt_alpha_into_lut_pass import FoldDyTAlphaIntoLUTPass
from etfold.decisions import collect_decisions
from etfold.demo_models.arm_dyt import DYT_CONV_KINDS as CONVS
from etfold.demo_models.arm_dyt import DyT, DyTConv, randomize_affine
from etfold.harness.arm_passes import (
    lower_tosa_without_and_with_passes,
    program_at,
    run_pass_on,
)
from etfold.harness.tosa_runner import quantize_for_tosa


class Sites(torch.nn.Module):
    """Several DyT -> conv sites reading the same input, each with its own alpha.

    Distinct alphas keep the TABLEs distinct (identical ones would be merged).
    """

    def __init__(self, sites):
        super().__init__()
        self.sites = torch.nn.ModuleList(sites)

    def forward(self, x):
        return tuple(site(x) for site in self.sites)


class FlatSites(Sites):
    """`Sites` whose sites return tuples: their outputs flattened into one tuple."""

    def forward(self, x):
        return tuple(output for site in self.sites for output in site(x))


def _matrix_sites(nhwc, kinds):
    sites = []
    for index, conv in enumerate(CONVS[kind] for kind in kinds):
        identity = DyTConv(4, 4, nhwc=nhwc, alpha=0.3 + 0.1 * index, **conv)
        random = DyTConv(4, 4, nhwc=nhwc, alpha=0.35 + 0.1 * index, **conv)
        randomize_affine(random.dyt, torch.Generator().manual_seed(index))
        sites += [identity, random]
    return sites


def _inputs(seed=3, count=3, channels=4):
    generator = torch.Generator().manual_seed(seed)
    return [(2 * torch.randn(1, channels, 5, 5, generator=generator),) for _ in range(count)]


def _integer_passes():
    return {
        "before": {InsertTableOpsPass: [FoldDyTAlphaIntoLUTPass()]},
        "after": {InsertTableOpsPass: [FoldDyTAffineIntoConvPass()]},
    }


def _lower_both(module, samples):
    """Unfolded and folded lowerings of one quantized program: codes must be identical."""
    program = quantize_for_tosa(module.eval(), samples[0], calibration=samples[1:])
    unfolded, folded, decisions = lower_tosa_without_and_with_passes(program, **_integer_passes())
    for sample in samples:
        for a, b in zip(unfolded.run(*sample).codes, folded.run(*sample).codes, strict=True):
            assert torch.equal(a, b)
    affine = [d for d in decisions if d.fold == FOLD]
    return unfolded.operator_counts(), folded.operator_counts(), affine


# One layout in `make test`, the other in `make test-long`.
NCHW_SHORT = [False, pytest.param(True, marks=pytest.mark.long)]


# A TOSA INT lowering of the whole matrix takes half a minute: `make test` runs a padded
# dense and an unpadded depthwise conv in NHWC, `make test-long` every kind in both layouts.
MATRIX_CASES = [
    pytest.param(True, ("3x3_padded", "dw1x1"), id="nhwc-two_kinds"),
    pytest.param(True, tuple(CONVS), id="nhwc", marks=pytest.mark.long),
    pytest.param(False, tuple(CONVS), id="nchw", marks=pytest.mark.long),
]


@pytest.mark.parametrize("nhwc, kinds", MATRIX_CASES)
def test_matrix_identity_folds_random_declines_bit_identically(nhwc, kinds):
    """Each conv kind of the matrix ({1x1, 3x3 padded, 3x3 unpadded, dw 3x3 padded,
    dw 1x1}) after an identity and after a random gamma/beta, in one program per layout."""
    torch.manual_seed(0)
    before, after, affine = _lower_both(Sites(_matrix_sites(nhwc, kinds)), _inputs())
    sites = 2 * len(kinds)
    assert (before["MUL"], before["ADD"], before["TABLE"]) == (2 * sites, sites, sites)
    # every alpha folds; identity gamma/beta go (their codes are the TABLE's); random ones stay
    assert (after["MUL"], after["ADD"], after["TABLE"]) == (sites // 2, sites // 2, sites)
    assert [d.applied for d in affine] == [True, False] * len(kinds)
    for identity, random in zip(affine[::2], affine[1::2], strict=True):
        assert identity.detail == "removed gamma/beta: their codes equal the TABLE's"
        assert "not exactly affine" in random.detail


def _with_affine(gamma, beta, **conv):
    module = DyTConv(4, 4, **conv).eval()
    with torch.no_grad():
        module.dyt.gamma.copy_(torch.tensor(gamma).reshape(module.dyt.gamma.shape))
        module.dyt.beta.copy_(torch.tensor(beta).reshape(module.dyt.beta.shape))
    return module


class ChannelSlice(torch.nn.Module):
    """A DyTConv whose conv reads only channels 1: of the DyT output."""

    def __init__(self, site):
        super().__init__()
        self.site = site
        site.conv = torch.nn.Conv2d(3, 4, 1)

    def forward(self, x):
        dyt = self.site.dyt
        y = dyt(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2) if self.site.nhwc else dyt(x)
        return self.site.conv(y[:, 1:])


# gamma 2 doubles the tanh range, so the sum's scale is exactly twice the TABLE's:
# slope 1 on three channels, and channel 2 (gamma 0) is the constant beta: slope 0 plus an offset
EXACT = dict(gamma=[2.0, 2.0, 0.0, 2.0], beta=[0.0, 0.0, 0.7, 0.0])


@pytest.mark.parametrize("nhwc", NCHW_SHORT, ids=["nchw", "nhwc"])
def test_exact_sites_fold_or_keep_beta_bit_identically(nhwc):
    torch.manual_seed(0)
    sites = [
        # real gamma/beta, exactly affine: weights and bias change
        _with_affine(**EXACT, nhwc=nhwc, kernel_size=3, alpha=0.5),
        # alpha 0: the TABLE emits one code, every channel folds as bias only
        _with_affine([0.5, -1.0, 1.5, 1.0], [0.1, -0.3, 0.2, 0.05], nhwc=nhwc, alpha=0.0),
        # padded conv, identity gamma, real beta: gamma goes, beta stays
        _with_affine(
            [1.0] * 4, [0.1, -0.3, 0.2, 0.05], nhwc=nhwc, kernel_size=3, padding=1, alpha=0.6
        ),
        # padded conv, exact affine with an offset: beta would differ on the border
        _with_affine(**EXACT, nhwc=nhwc, kernel_size=3, padding=1, alpha=0.7),
        # the conv reads channels 1: of the affine, through one slice
        ChannelSlice(_with_affine(**EXACT, nhwc=nhwc, alpha=0.8)),
    ]
    before, after, affine = _lower_both(Sites(sites), _inputs())
    exact, singleton, kept_beta, padded, sliced = affine
    assert exact.applied and "slopes [0, 1], 1 channels with an offset" in exact.detail
    assert singleton.applied and "slopes [0], 4 channels with an offset" in singleton.detail
    assert kept_beta.applied and "removed the identity gamma, kept beta" in kept_beta.detail
    assert not padded.applied
    assert padded.detail == "padded conv: beta's contribution at the border is not one bias"
    assert sliced.applied and "slopes [0, 1], 1 channels with an offset" in sliced.detail
    assert (before["MUL"], before["ADD"]) == (10, 5)
    # alphas: -5 MUL; exact, singleton, sliced: -3 MUL -3 ADD; kept beta: -1 MUL
    assert (after["MUL"], after["ADD"]) == (1, 2)
    assert after["RESCALE"] < before["RESCALE"]


# --- guards, one probe each: graph unchanged and the reason recorded ----------------


@functools.cache
def _snapshot(kind):
    """The program as the affine pass sees it (after InsertTableOpsPass), per model kind."""
    samples = _inputs(channels=1 if kind == "broadcast_table" else 4)
    modules = {
        "exact": lambda: _with_affine(**EXACT),
        "random": lambda: _with_affine([0.7, 1.3, -0.6, 1.1], [0.2, -0.1, 0.3, 0.0]),
        "two_permutes": lambda: DoublePermute(),
        "shared_permute": lambda: SharedPermute(),
        "broadcast_table": lambda: BroadcastTable(),
        "spatial_gamma": lambda: SpatialGamma(),
    }
    torch.manual_seed(0)
    program = quantize_for_tosa(modules[kind]().eval(), samples[0], calibration=samples[1:])
    return program_at(
        program,
        before={InsertTableOpsPass: [FoldDyTAlphaIntoLUTPass()]},
        capture_after=InsertTableOpsPass,
    )


def _probe(kind, mutate=None):
    snapshot = _snapshot(kind)
    with collect_decisions() as decisions:
        before, after, _ = run_pass_on(snapshot, FoldDyTAffineIntoConvPass(), mutate)
    assert after == before
    assert [(d.fold, d.applied) for d in decisions] == [(FOLD, False)]
    return decisions[0].detail


def _placeholder_behind(node):
    while node.op != "placeholder":
        node = node.args[0]
    return node.name


def test_fold_removes_constants_nothing_reads_any_more():
    snapshot = _snapshot("exact")
    graph = snapshot.graph_module.graph
    mul = next(n for n in graph.nodes if n.target == exir_ops.edge.aten.mul.Tensor)
    add = next(n for n in graph.nodes if n.target == exir_ops.edge.aten.add.Tensor)
    conv = _last_conv(snapshot.graph_module)
    gamma = _placeholder_behind(
        next(a for a in mul.args if a.target == exir_ops.edge.aten.view_copy.default)
    )
    beta = _placeholder_behind(
        next(a for a in add.args if a.target == exir_ops.edge.aten.view_copy.default)
    )
    gone = {gamma, beta, conv.args[1].name, conv.args[2].name}
    with collect_decisions() as decisions:
        _, _, program = run_pass_on(snapshot, FoldDyTAffineIntoConvPass())
    assert [(d.fold, d.applied) for d in decisions] == [(FOLD, True)]
    placeholders = {n.name for n in program.graph_module.graph.nodes if n.op == "placeholder"}
    assert not gone & placeholders
    assert not gone & set(program.graph_signature.inputs_to_buffers)
    folded = _last_conv(program.graph_module)
    assert "dyt_folded_for" in folded.args[1].name and "dyt_folded_for" in folded.args[2].name


def _last_conv(graph_module):
    return [
        n for n in graph_module.graph.nodes if n.target == exir_ops.edge.aten.convolution.default
    ][-1]


def _table(graph_module):
    return next(
        n for n in graph_module.graph.nodes if n.target == exir_ops.backend.tosa.TABLE.default
    )


def test_declines_when_conv_is_transposed():
    def transpose(graph_module, _):
        conv = _last_conv(graph_module)
        conv.args = (*conv.args[:6], True, *conv.args[7:])

    assert _probe("exact", transpose) == "the conv is transposed"


class DoublePermute(torch.nn.Module):
    """Two permutes between an exactly affine gamma/beta (EXACT's) and the conv."""

    def __init__(self):
        super().__init__()
        self.dyt = DyT(4, nhwc=True)
        with torch.no_grad():
            self.dyt.gamma.copy_(torch.tensor(EXACT["gamma"]))
            self.dyt.beta.copy_(torch.tensor(EXACT["beta"]))
        self.conv = torch.nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.dyt(x.permute(0, 2, 3, 1))
        return self.conv(y.permute(0, 3, 2, 1).permute(0, 1, 3, 2))


def test_declines_when_layout_provenance_is_ambiguous():
    assert "ambiguous layout provenance" in _probe("two_permutes")


class SharedPermute(torch.nn.Module):
    """The conv's layout permute is also a model output; gamma/beta as given."""

    def __init__(self, gamma=(2.0, 2.0, 0.0, 2.0), beta=(0.0, 0.0, 0.7, 0.0), padding=0, alpha=0.5):
        super().__init__()
        self.dyt = DyT(4, nhwc=True, alpha=alpha)
        with torch.no_grad():
            self.dyt.gamma.copy_(torch.tensor(gamma))
            self.dyt.beta.copy_(torch.tensor(beta))
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=padding)

    def forward(self, x):
        y = self.dyt(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.conv(y), y


def test_declines_when_conv_input_layout_is_shared():
    """Exactly affine (EXACT's gamma/beta), but the permute also feeds an output."""
    assert "conv input is shared" in _probe("shared_permute")


def test_identity_gamma_goes_even_where_the_layout_permute_is_shared():
    """Removing an identity prefix leaves the layout alone, so a shared permute is no
    obstacle: an unpadded and a padded conv, two sites of one program."""
    torch.manual_seed(0)
    identity = dict(gamma=(1.0,) * 4, beta=(0.1, -0.3, 0.2, 0.05))
    module = FlatSites(
        [
            SharedPermute(**identity, padding=0, alpha=0.5),
            SharedPermute(**identity, padding=1, alpha=0.6),
        ]
    )
    before, after, affine = _lower_both(module, _inputs())
    assert [d.applied for d in affine] == [True, True]
    for decision in affine:
        assert "removed the identity gamma, kept beta (the conv input is shared" in decision.detail
    # per site: alpha, gamma
    assert (before["MUL"] - after["MUL"], before["ADD"] - after["ADD"]) == (4, 0)


def test_declines_when_table_zero_point_mismatches_chain():
    def shift_table_zero_point(graph_module, _):
        table = _table(graph_module)
        qargs = table.meta["output_qparams"][0]
        table.meta["output_qparams"] = {0: qargs._replace(zp=qargs.zp + 1)}

    assert "TABLE zero point" in _probe("exact", shift_table_zero_point)


def test_declines_when_table_values_are_not_an_int8_constant():
    def widen_table(graph_module, exported_program):
        values = _table(graph_module).args[1]
        target = exported_program.graph_signature.inputs_to_buffers[values.name]
        exported_program.state_dict[target] = exported_program.state_dict[target].to(torch.int16)

    assert "256-entry int8 constant" in _probe("exact", widen_table)


def test_declines_when_conv_zero_point_differs_from_affine_output():
    def shift_conv_zero_point(graph_module, _):
        conv = _last_conv(graph_module)
        qparams = dict(conv.meta["input_qparams"])
        qparams[0] = qparams[0]._replace(zp=qparams[0].zp + 1)
        conv.meta["input_qparams"] = qparams

    assert "conv input zero point" in _probe("exact", shift_conv_zero_point)


class BroadcastTable(torch.nn.Module):
    """A one-channel tanh broadcast to four channels by gamma."""

    def __init__(self):
        super().__init__()
        self.alpha = torch.nn.Parameter(torch.tensor([0.5]))
        self.gamma = torch.nn.Parameter(torch.tensor([2.0, 2.0, 0.0, 2.0]))
        self.beta = torch.nn.Parameter(torch.tensor([0.0, 0.0, 0.7, 0.0]))
        self.conv = torch.nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.gamma * torch.tanh(self.alpha * x.permute(0, 2, 3, 1)) + self.beta
        return self.conv(y.permute(0, 3, 1, 2))


def test_declines_when_table_is_broadcast_by_the_affine():
    assert "TABLE output is broadcast" in _probe("broadcast_table")


class SpatialGamma(torch.nn.Module):
    """gamma varies along W (shape [W, 1] against NHWC): not a channel affine."""

    def __init__(self):
        super().__init__()
        self.dyt = DyT(4, nhwc=True)
        with torch.no_grad():
            self.dyt.gamma = torch.nn.Parameter(torch.linspace(0.5, 1.5, 5).reshape(5, 1))
        self.conv = torch.nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return self.conv(self.dyt(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


def test_declines_when_gamma_varies_along_a_non_channel_axis():
    assert "non-channel axis" in _probe("spatial_gamma")


def test_declines_when_conv_bias_is_not_a_constant():
    def drop_bias(graph_module, _):
        conv = _last_conv(graph_module)
        conv.args = (conv.args[0], conv.args[1], None, *conv.args[3:])

    assert "conv bias is not a constant" in _probe("exact", drop_bias)


def test_declines_when_int32_arithmetic_saturates():
    def huge_gamma_rescale(graph_module, _):
        mul = next(n for n in graph_module.graph.nodes if n.target == exir_ops.edge.aten.mul.Tensor)
        view = next(a for a in mul.args if a.target == exir_ops.edge.aten.view_copy.default)
        rescale = view.args[0]
        rescale.args = (*rescale.args[:2], [2.0**28], *rescale.args[3:])

    assert "saturating map" in _probe("exact", huge_gamma_rescale)


def test_declines_when_map_is_nonlinear():
    assert "not exactly affine" in _probe("random")


def test_declines_when_folded_weights_leave_int8_range():
    def narrow_weight_range(graph_module, _):
        conv = _last_conv(graph_module)
        qparams = dict(conv.meta["input_qparams"])
        qparams[1] = qparams[1]._replace(qmin=-2, qmax=2)
        conv.meta["input_qparams"] = qparams

    assert "folded int8 weights leave" in _probe("exact", narrow_weight_range)


def test_declines_when_folded_bias_overflows_int32():
    def saturate_bias(graph_module, exported_program):
        bias = _last_conv(graph_module).args[2]
        target = (
            exported_program.graph_signature.inputs_to_buffers.get(bias.name)
            or exported_program.graph_signature.inputs_to_parameters[bias.name]
        )
        extremes = torch.tensor([2**31 - 1, -(2**31)] * 2, dtype=torch.int32)
        exported_program.state_dict[target] = extremes

    assert "bias overflows" in _probe("exact", saturate_bias)


# --- standalone, as upstream's tests run it: no lowering context, fake values only on placeholders


def _without_fake_values(snapshot, placeholders=False):
    program = copy.deepcopy(snapshot)
    for node in program.graph_module.graph.nodes:
        if node.op == "call_function" or (placeholders and node.op == "placeholder"):
            node.meta.pop("val", None)
    return program


def test_runs_standalone_making_its_own_context_and_fake_values():
    _, inside_pipeline, _ = run_pass_on(_snapshot("exact"), FoldDyTAffineIntoConvPass())
    program = _without_fake_values(_snapshot("exact"))
    with collect_decisions() as decisions:
        result = FoldDyTAffineIntoConvPass(program).call(program.graph_module)
    assert result.modified and [(d.fold, d.applied) for d in decisions] == [(FOLD, True)]
    assert result.graph_module.code == inside_pipeline


def test_declines_when_no_fake_values_can_be_made():
    program = _without_fake_values(_snapshot("exact"), placeholders=True)
    before = program.graph_module.code
    with collect_decisions() as decisions:
        result = FoldDyTAffineIntoConvPass(program).call(program.graph_module)
    assert not result.modified and program.graph_module.code == before
    assert [(d.fold, d.applied) for d in decisions] == [(FOLD, False)]
    assert "placeholders carry no static meta['val']" in decisions[0].detail


# --- a following linear: upstream lowers it to a 1x1 conv between two view_copy


class DyTLinear(torch.nn.Module):
    """Tokens [B, T, C] -> DyT over C -> Linear (a ViT block's norm -> qkv/fc1), or
    with `flatten` the tokens merged into the features first (no channel axis left)."""

    def __init__(self, gamma, beta, alpha=0.5, flatten=False):
        super().__init__()
        self.dyt = DyT(4, nhwc=True, alpha=alpha)
        with torch.no_grad():
            self.dyt.gamma.copy_(torch.tensor(gamma))
            self.dyt.beta.copy_(torch.tensor(beta))
        self.flatten = flatten
        self.fc = torch.nn.Linear(20 if flatten else 4, 6)

    def forward(self, x):
        y = self.dyt(x)
        return self.fc(y.reshape(1, 20) if self.flatten else y)


def _token_inputs(seed=5, count=3):
    generator = torch.Generator().manual_seed(seed)
    return [(2 * torch.randn(1, 5, 4, generator=generator),) for _ in range(count)]


@functools.cache
def _linear_sites():
    """Four DyT -> Linear sites of one program, lowered unfolded and folded (codes equal)."""
    torch.manual_seed(0)
    sites = [
        DyTLinear(**EXACT, alpha=0.5),  # exactly affine: weight and bias change
        DyTLinear([1.0] * 4, [0.0] * 4, alpha=0.6),  # identity: the chain goes
        DyTLinear([0.7, 1.3, -0.6, 1.1], [0.2, -0.1, 0.3, 0.0], alpha=0.7),  # not affine
        DyTLinear(**EXACT, alpha=0.8, flatten=True),  # the view merges the channel axis
    ]
    module = Sites(sites)
    user_state = copy.deepcopy(module.state_dict())
    before, after, affine = _lower_both(module, _token_inputs())
    return module, user_state, before, after, tuple(affine)


def test_gamma_beta_fold_into_a_following_linear_through_its_views_bit_identically():
    module, user_state, before, after, affine = _linear_sites()
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in user_state.items())
    exact, identity, random, merged = affine
    assert exact.applied and "slopes [0, 1], 1 channels with an offset" in exact.detail
    assert (
        identity.applied and identity.detail == "removed gamma/beta: their codes equal the TABLE's"
    )
    assert not random.applied and "not exactly affine" in random.detail
    assert not merged.applied  # the next test reads its reason
    # alphas: -4 MUL; exact and identity: -2 MUL -2 ADD; the merging site keeps its own
    assert (before["MUL"] - after["MUL"], before["ADD"] - after["ADD"]) == (6, 2)


def test_declines_when_a_view_merges_the_channel_axis():
    *_, affine = _linear_sites()
    assert len(affine) == 4  # one decision per site; the fourth site flattens the tokens
    merged = affine[3]
    assert not merged.applied
    assert "splits or merges its channel axis" in merged.detail
