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
from etfold.demo_models.arm_dyt import DyT, DyTConv, randomize_affine
from etfold.harness.arm_passes import (
    ProbePass,
    arm_pass_insertions,
    lower_tosa_with_passes,
    lower_until_probe,
)
from etfold.harness.tosa_runner import lower_tosa, quantize_for_tosa

CONVS = {
    "1x1": dict(kernel_size=1),
    "3x3_padded": dict(kernel_size=3, padding=1),
    "3x3_unpadded": dict(kernel_size=3),
    "dw3x3_padded": dict(kernel_size=3, padding=1, depthwise=True),
    "dw1x1": dict(kernel_size=1, depthwise=True),
}


class TwoSites(torch.nn.Module):
    """The same input through an identity-gamma/beta DyT site and a random one."""

    def __init__(self, nhwc, conv):
        super().__init__()
        self.identity = DyTConv(4, 4, nhwc=nhwc, **conv)
        self.random = DyTConv(4, 4, nhwc=nhwc, alpha=0.8, **conv)
        randomize_affine(self.random.dyt, torch.Generator().manual_seed(1))

    def forward(self, x):
        return self.identity(x), self.random(x)


def _inputs(seed=3, count=3, channels=4):
    generator = torch.Generator().manual_seed(seed)
    return [(2 * torch.randn(1, channels, 5, 5, generator=generator),) for _ in range(count)]


def _integer_passes():
    return {
        "before": {InsertTableOpsPass: [FoldDyTAlphaIntoLUTPass()]},
        "after": {InsertTableOpsPass: [FoldDyTAffineIntoConvPass()]},
    }


def _lower_both(module, samples):
    program = quantize_for_tosa(module.eval(), samples[0], calibration=samples[1:])
    unfolded = lower_tosa_with_passes(program)
    with collect_decisions() as decisions:
        folded = lower_tosa_with_passes(program, **_integer_passes())
    for sample in samples:
        for a, b in zip(unfolded.run(*sample).codes, folded.run(*sample).codes, strict=True):
            assert torch.equal(a, b)
    affine = [d for d in decisions if d.fold == FOLD]
    return unfolded.operator_counts(), folded.operator_counts(), affine


@pytest.mark.parametrize("conv", list(CONVS), ids=list(CONVS))
@pytest.mark.parametrize("nhwc", [True, False], ids=["nhwc", "nchw"])
def test_identity_folds_random_declines_bit_identically(nhwc, conv):
    torch.manual_seed(0)
    before, after, affine = _lower_both(TwoSites(nhwc, CONVS[conv]), _inputs())
    assert (before["MUL"], before["ADD"], before["TABLE"]) == (4, 2, 2)
    # both alphas fold; the identity site's gamma/beta fold; the random site's stay
    assert (after["MUL"], after["ADD"], after["TABLE"]) == (1, 1, 2)
    assert [d.applied for d in affine] == [True, False]
    assert "slopes [1]" in affine[0].detail
    assert "not exactly affine" in affine[1].detail


def _with_affine(gamma, beta, **conv):
    torch.manual_seed(0)
    module = DyTConv(4, 4, **conv).eval()
    with torch.no_grad():
        module.dyt.gamma.copy_(torch.tensor(gamma).reshape(module.dyt.gamma.shape))
        module.dyt.beta.copy_(torch.tensor(beta).reshape(module.dyt.beta.shape))
    return module


# gamma 2 doubles the tanh range, so the sum's scale is exactly twice the TABLE's:
# slope 1 on three channels, and channel 2 (gamma 0) is the constant beta: slope 0 plus an offset
EXACT = dict(gamma=[2.0, 2.0, 0.0, 2.0], beta=[0.0, 0.0, 0.7, 0.0])


@pytest.mark.parametrize("nhwc", [True, False], ids=["nhwc", "nchw"])
def test_real_gamma_beta_fold_exactly_into_weight_and_bias(nhwc):
    before, after, affine = _lower_both(_with_affine(**EXACT, nhwc=nhwc, kernel_size=3), _inputs())
    assert [d.applied for d in affine] == [True]
    assert "slopes [0, 1]" in affine[0].detail and "1 channels with an offset" in affine[0].detail
    assert (before["MUL"], before["ADD"]) == (2, 1) and (after["MUL"], after["ADD"]) == (0, 0)
    assert after["RESCALE"] < before["RESCALE"]


def test_singleton_code_table_folds_as_bias_only():
    # alpha 0: every input maps to one TABLE code, so each channel is a constant
    module = _with_affine([0.5, -1.0, 1.5, 1.0], [0.1, -0.3, 0.2, 0.05], alpha=0.0)
    before, after, affine = _lower_both(module, _inputs())
    assert [d.applied for d in affine] == [True]
    assert "slopes [0]" in affine[0].detail and "4 channels with an offset" in affine[0].detail
    assert (after["MUL"], after["ADD"]) == (0, 0)


def test_padded_conv_keeps_beta_when_gamma_is_identity():
    module = _with_affine([1.0] * 4, [0.1, -0.3, 0.2, 0.05], kernel_size=3, padding=1)
    before, after, affine = _lower_both(module, _inputs())
    assert [d.applied for d in affine] == [True]
    assert "kept beta" in affine[0].detail
    assert (after["MUL"], after["ADD"]) == (0, 1)


def test_declines_when_padding_puts_beta_on_the_border():
    before, after, affine = _lower_both(_with_affine(**EXACT, kernel_size=3, padding=1), _inputs())
    assert [(d.applied, d.detail) for d in affine] == [
        (False, "padded conv: beta's contribution at the border is not one bias")
    ]
    assert (after["MUL"], after["ADD"]) == (before["MUL"] - 1, before["ADD"])


# --- guards, one probe each: graph unchanged and the reason recorded ----------------


@functools.cache
def _quantized(kind):
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
    return quantize_for_tosa(modules[kind]().eval(), samples[0], calibration=samples[1:])


def _probe(kind, mutate=None):
    probe = ProbePass(FoldDyTAffineIntoConvPass(), mutate)
    passes = {
        "before": {InsertTableOpsPass: [FoldDyTAlphaIntoLUTPass()]},
        "after": {InsertTableOpsPass: [probe]},
    }
    with collect_decisions() as decisions, arm_pass_insertions(**passes):
        lower_until_probe(lower_tosa, copy.deepcopy(_quantized(kind)))
    assert probe.code_before is not None, "the probe never ran"
    assert probe.code_after == probe.code_before
    affine = [d for d in decisions if d.fold == FOLD]
    assert [d.applied for d in affine] == [False]
    return affine[0].detail


def _conv(graph_module):
    return next(
        n
        for n in graph_module.graph.nodes
        if n.target == exir_ops.edge.aten.convolution.default
        and "TABLE" not in str(n.args[0].target)
        and n.args[1].name != "x"
    )


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
    def __init__(self):
        super().__init__()
        self.dyt = DyT(4, nhwc=True)
        self.conv = torch.nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.dyt(x.permute(0, 2, 3, 1))
        return self.conv(y.permute(0, 3, 2, 1).permute(0, 1, 3, 2))


def test_declines_when_layout_provenance_is_ambiguous():
    assert "ambiguous layout provenance" in _probe("two_permutes")


class SharedPermute(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dyt = DyT(4, nhwc=True)
        self.conv = torch.nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.dyt(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.conv(y), y


def test_declines_when_conv_input_layout_is_shared():
    assert "conv input is shared" in _probe("shared_permute")


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
