# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""FoldDyTAffineIntoConvFloatPass: gamma/beta into the next conv before calibration.

Exactness is checked in fp32 on the rewritten graph; the quantized effect on the
TOSA reference model, against stock ExecuTorch lowering the same model.
"""

import copy

import pytest
import torch

from etfold.backends.arm import arm_folds_registered
from etfold.backends.arm._passes.fold_dyt_affine_into_conv_float_pass import (
    FOLD,
    MAX_GAMMA_SPREAD,
    MAX_SHIFT,
    FoldDyTAffineIntoConvFloatPass,
)
from etfold.decisions import collect_decisions
from etfold.demo_models.arm_dyt import DYT_CONV_KINDS as CONVS
from etfold.demo_models.arm_dyt import DyT, DyTConv, randomize_affine
from etfold.harness.tosa_runner import lower_module_tosa, output_scales


def _random_dyt_conv(nhwc, seed=1, **conv):
    torch.manual_seed(0)
    module = DyTConv(4, 4, nhwc=nhwc, **conv).eval()
    randomize_affine(module.dyt, torch.Generator().manual_seed(seed))
    return module


def _fold_graph(module, x):
    """The pass on the exported ATen graph module (as the annotation pipeline sees it)."""
    graph_module = torch.export.export(module, (x,)).module(check_guards=False)
    before = graph_module.code
    with collect_decisions() as decisions:
        FoldDyTAffineIntoConvFloatPass()(graph_module)
    return graph_module, before, [d for d in decisions if d.fold == FOLD]


def _count(graph_module, name):
    return sum(
        1 for n in graph_module.graph.nodes if n.op == "call_function" and name in str(n.target)
    )


@pytest.mark.parametrize("conv", list(CONVS), ids=list(CONVS))
@pytest.mark.parametrize("nhwc", [True, False], ids=["nhwc", "nchw"])
def test_fold_is_exact_in_fp32(nhwc, conv):
    module = _random_dyt_conv(nhwc, **CONVS[conv])
    x = torch.randn(1, 4, 6, 6, generator=torch.Generator().manual_seed(5))
    graph_module, _, decisions = _fold_graph(module, x)
    assert [d.applied for d in decisions] == [True]
    padded = CONVS[conv].get("padding", 0) > 0
    assert _count(graph_module, "aten.mul") == 1  # only alpha * x is left
    assert _count(graph_module, "aten.add") == (1 if padded else 0)
    assert ("beta kept" in decisions[0].detail) == padded
    torch.testing.assert_close(graph_module(x), module(x), atol=1e-5, rtol=1e-5)


def test_grouped_conv_folds_exactly():
    torch.manual_seed(0)
    module = DyTConv(4, 6, nhwc=True).eval()
    module.conv = torch.nn.Conv2d(4, 6, 3, groups=2)
    randomize_affine(module.dyt, torch.Generator().manual_seed(2))
    x = torch.randn(1, 4, 6, 6)
    graph_module, _, decisions = _fold_graph(module, x)
    assert [d.applied for d in decisions] == [True]
    torch.testing.assert_close(graph_module(x), module(x), atol=1e-5, rtol=1e-5)


def _lsb_errors(program, module, samples):
    scale = output_scales(program)[0]
    errors = torch.cat(
        [(program.run(*s).outputs[0] - module(*s)).abs().flatten() / scale for s in samples]
    )
    return float(errors.max()), float(errors.mean())


def _stock_and_etfold(module, samples):
    stock, _ = lower_module_tosa(copy.deepcopy(module), samples[0], calibration=samples[1:])
    with arm_folds_registered(), collect_decisions() as decisions:
        folded, _ = lower_module_tosa(copy.deepcopy(module), samples[0], calibration=samples[1:])
    return stock, folded, decisions


def _samples(count=4):
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(1, 4, 6, 6, generator=generator),) for _ in range(count)]


@pytest.mark.parametrize(
    ("nhwc", "conv"), [(True, "1x1"), (False, "3x3_unpadded")], ids=["nhwc-1x1", "nchw-3x3"]
)
def test_random_gamma_beta_leave_no_mul_or_add_and_no_worse_error(nhwc, conv):
    module = _random_dyt_conv(nhwc, **CONVS[conv])
    samples = _samples()
    stock, folded, decisions = _stock_and_etfold(module, samples)
    assert [(d.fold, d.applied) for d in decisions if d.fold == FOLD] == [(FOLD, True)]
    assert (stock.operator_counts()["MUL"], stock.operator_counts()["ADD"]) == (2, 1)
    assert (folded.operator_counts()["MUL"], folded.operator_counts()["ADD"]) == (0, 0)
    stock_max, stock_mean = _lsb_errors(stock, module, samples)
    folded_max, folded_mean = _lsb_errors(folded, module, samples)
    assert folded_max <= stock_max and folded_mean <= stock_mean


def test_padded_conv_keeps_beta_and_drops_the_gamma_mul():
    module = _random_dyt_conv(True, **CONVS["3x3_padded"])
    samples = _samples()
    stock, folded, decisions = _stock_and_etfold(module, samples)
    applied = [d for d in decisions if d.fold == FOLD]
    assert [d.applied for d in applied] == [True] and "beta kept" in applied[0].detail
    assert (folded.operator_counts()["MUL"], folded.operator_counts()["ADD"]) == (0, 1)
    stock_max, stock_mean = _lsb_errors(stock, module, samples)
    folded_max, folded_mean = _lsb_errors(folded, module, samples)
    # one requantization fewer: on average no worse; the worst element may move by one LSB
    assert folded_mean <= stock_mean and folded_max <= stock_max + 1.0


def test_user_module_is_untouched():
    module = _random_dyt_conv(True, **CONVS["1x1"])
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with arm_folds_registered():
        lower_module_tosa(module, _samples(1)[0])
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


# --- the quantization bound, on both sides ------------------------------------------


def _with_gamma(gamma, beta=None, **conv):
    torch.manual_seed(0)
    module = DyTConv(4, 4, nhwc=True, **conv).eval()
    with torch.no_grad():
        module.dyt.gamma.copy_(torch.tensor(gamma))
        module.dyt.beta.copy_(torch.tensor(beta if beta is not None else [0.1, -0.2, 0.0, 0.3]))
    return module


def test_gamma_spread_at_the_bound_folds():
    gamma = [0.25, 0.25 * MAX_GAMMA_SPREAD, -0.5, 1.0]
    graph_module, _, decisions = _fold_graph(_with_gamma(gamma), torch.randn(1, 4, 6, 6))
    assert [d.applied for d in decisions] == [True]


def test_declines_when_gamma_spread_exceeds_the_bound():
    gamma = [0.25, 0.25 * MAX_GAMMA_SPREAD * 1.01, -0.5, 1.0]
    graph_module, before, decisions = _fold_graph(_with_gamma(gamma), torch.randn(1, 4, 6, 6))
    assert graph_module.code == before
    assert [d.applied for d in decisions] == [False]
    assert "gamma spread" in decisions[0].detail and f"{MAX_GAMMA_SPREAD:g}" in decisions[0].detail


def test_depthwise_conv_has_no_spread_to_bound():
    gamma = [0.01, 10.0, -0.5, 1.0]  # each output channel reads one input channel
    module = _with_gamma(gamma, kernel_size=1, depthwise=True)
    _, _, decisions = _fold_graph(module, torch.randn(1, 4, 6, 6))
    assert [d.applied for d in decisions] == [True]


def test_declines_when_padded_beta_would_shift_tanh_too_far():
    gamma, beta = [0.2, 1.0, 1.0, 1.0], [MAX_SHIFT * 0.2 * 1.5, 0.0, 0.0, 0.0]
    module = _with_gamma(gamma, beta, kernel_size=3, padding=1)
    graph_module, before, decisions = _fold_graph(module, torch.randn(1, 4, 6, 6))
    assert graph_module.code == before
    assert "beta / gamma" in decisions[0].detail and not decisions[0].applied


def test_declines_when_padded_beta_meets_zero_gamma():
    module = _with_gamma([0.0, 1.0, 1.0, 1.0], [0.3, 0.0, 0.0, 0.0], kernel_size=3, padding=1)
    graph_module, before, decisions = _fold_graph(module, torch.randn(1, 4, 6, 6))
    assert graph_module.code == before
    assert "gamma is 0" in decisions[0].detail and not decisions[0].applied


# --- other declines ------------------------------------------------------------------


class TwoPermutes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dyt = DyT(4, nhwc=True)
        self.conv = torch.nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.dyt(x.permute(0, 2, 3, 1))
        return self.conv(y.permute(0, 3, 2, 1).permute(0, 1, 3, 2))


def test_declines_when_layout_provenance_is_ambiguous():
    graph_module, before, decisions = _fold_graph(TwoPermutes().eval(), torch.randn(1, 4, 6, 6))
    assert graph_module.code == before
    assert "ambiguous layout provenance" in decisions[0].detail


class DyTAlsoReturned(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dyt = DyT(4, nhwc=False)
        self.conv = torch.nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.dyt(x)
        return self.conv(y), y


def test_declines_when_dyt_output_has_other_users():
    graph_module, before, decisions = _fold_graph(DyTAlsoReturned().eval(), torch.randn(1, 4, 6, 6))
    assert graph_module.code == before
    assert "users other than the conv" in decisions[0].detail


class SpatialGamma(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dyt = DyT(4, nhwc=True)
        self.dyt.gamma = torch.nn.Parameter(torch.linspace(0.5, 1.5, 6).reshape(6, 1))
        self.conv = torch.nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return self.conv(self.dyt(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


def test_declines_when_gamma_varies_along_a_non_channel_axis():
    graph_module, before, decisions = _fold_graph(SpatialGamma().eval(), torch.randn(1, 4, 6, 6))
    assert graph_module.code == before
    assert "channel axis only" in decisions[0].detail


def test_declines_when_gamma_is_not_finite():
    module = _with_gamma([1.0, float("nan"), 1.0, 1.0])
    graph_module, before, decisions = _fold_graph(module, torch.randn(1, 4, 6, 6))
    assert graph_module.code == before
    assert "NaN or Inf" in decisions[0].detail


def test_declines_when_conv_channels_do_not_line_up():
    module = DyTConv(4, 4, nhwc=False).eval()
    x = torch.randn(1, 4, 6, 6)
    graph_module = torch.export.export(module, (x,)).module(check_guards=False)
    add = next(n for n in graph_module.graph.nodes if "aten.add" in str(n.target))
    add.meta["val"] = add.meta["val"].new_empty((1, 3, 6, 6))  # the conv reads 4 channels
    before = graph_module.code
    with collect_decisions() as decisions:
        FoldDyTAffineIntoConvFloatPass()(graph_module)
    assert graph_module.code == before
    assert "do not line up" in decisions[0].detail


class DyTViewLinear(torch.nn.Module):
    """[B, T, C] tokens -> DyT -> view to [B*T, C] (or, `merge`, to [B, T*C]) -> Linear."""

    def __init__(self, merge=False):
        super().__init__()
        self.dyt = DyT(4, nhwc=True)
        randomize_affine(self.dyt, torch.Generator().manual_seed(4))
        self.merge = merge
        self.fc = torch.nn.Linear(20 if merge else 4, 6)

    def forward(self, x):
        y = self.dyt(x)
        return self.fc(y.reshape(1, 20) if self.merge else y.reshape(5, 4))


def test_folds_into_a_following_linear_through_a_view_exactly():
    torch.manual_seed(0)
    module = DyTViewLinear().eval()
    x = torch.randn(1, 5, 4, generator=torch.Generator().manual_seed(6))
    graph_module, _, decisions = _fold_graph(module, x)
    assert [d.applied for d in decisions] == [True]
    assert _count(graph_module, "aten.mul") == 1 and _count(graph_module, "aten.add") == 0
    torch.testing.assert_close(graph_module(x), module(x), atol=1e-5, rtol=1e-5)


def test_declines_when_a_view_merges_the_channel_axis():
    torch.manual_seed(0)
    module = DyTViewLinear(merge=True).eval()
    x = torch.randn(1, 5, 4)
    graph_module, before, decisions = _fold_graph(module, x)
    assert graph_module.code == before
    assert [d.applied for d in decisions] == [False]
    assert "views keeping the channel axis whole" in decisions[0].detail
    assert "views keeping the channel axis whole" in decisions[0].detail


def _without_fake_values(graph_module, placeholders=False):
    for node in graph_module.graph.nodes:
        if node.op == "call_function" or (placeholders and node.op == "placeholder"):
            node.meta.pop("val", None)
    return graph_module


def test_runs_standalone_making_missing_fake_values():
    module = _random_dyt_conv(True, **CONVS["1x1"])
    x = torch.randn(1, 4, 6, 6, generator=torch.Generator().manual_seed(5))
    graph_module = _without_fake_values(torch.export.export(module, (x,)).module())
    with collect_decisions() as decisions:
        assert FoldDyTAffineIntoConvFloatPass()(graph_module).modified
    assert [d.applied for d in decisions if d.fold == FOLD] == [True]
    torch.testing.assert_close(graph_module(x), module(x), atol=1e-5, rtol=1e-5)


def test_declines_when_no_fake_values_can_be_made():
    module = _random_dyt_conv(True, **CONVS["1x1"])
    x = torch.randn(1, 4, 6, 6)
    graph_module = torch.export.export(module, (x,)).module()
    graph_module = _without_fake_values(graph_module, placeholders=True)
    before = graph_module.code
    with collect_decisions() as decisions:
        assert not FoldDyTAffineIntoConvFloatPass()(graph_module).modified
    assert graph_module.code == before
    assert [(d.applied, d.fold) for d in decisions] == [(False, FOLD)]
    assert "carry no static meta['val']" in decisions[0].detail


def test_flatten_that_keeps_the_channel_axis_folds_exactly():
    """A flatten is a view (layout_axes): with the channel axis whole through it, the
    affine folds into the linear as through a reshape."""

    class FlattenThenLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dyt = DyT(4, nhwc=True)
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(self.dyt(x).flatten(0, 1))

    torch.manual_seed(0)
    module = FlattenThenLinear().eval()
    randomize_affine(module.dyt, torch.Generator().manual_seed(4))
    x = torch.randn(2, 5, 4)
    graph_module, _, decisions = _fold_graph(module, x)
    assert [d.applied for d in decisions] == [True]
    assert _count(graph_module, "aten.add") == 0 and _count(graph_module, "aten.mul") == 1
    torch.testing.assert_close(graph_module(x), module(x), atol=1e-5, rtol=1e-5)
