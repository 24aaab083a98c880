# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""FoldDyTAlphaIntoLUTPass on TOSA INT: one TABLE for tanh(alpha * x), bit-identical codes."""

import functools

import pytest
import torch
from executorch.backends.arm._passes.insert_table_ops import InsertTableOpsPass
from executorch.exir.dialects._ops import ops as exir_ops

from etfold.backends.arm._passes.fold_dyt_alpha_into_lut_pass import (
    FOLD,
    FoldDyTAlphaIntoLUTPass,
)
from etfold.decisions import collect_decisions
from etfold.harness.arm_passes import (
    lower_tosa_with_passes,
    lower_tosa_without_and_with_passes,
    program_at,
    run_pass_on,
)
from etfold.harness.tosa_runner import quantize_for_tosa


class TanhOfScaled(torch.nn.Module):
    """tanh(alpha * x) in NHWC (after a permute) or NCHW (straight off the input)."""

    def __init__(self, alpha: float = 0.5, nhwc: bool = True):
        super().__init__()
        self.alpha = torch.nn.Parameter(torch.tensor([alpha]))
        self.nhwc = nhwc

    def forward(self, x):
        if self.nhwc:
            x = x.permute(0, 2, 3, 1)
        return torch.tanh(self.alpha * x)


def _inputs(seed=0, count=3, scale=3.0):
    generator = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(1, 3, 6, 6, generator=generator),) for _ in range(count)]


def _sweep():
    """Inputs covering every int8 code the quantized activation can take."""
    ramp = torch.linspace(-12.0, 12.0, 3 * 6 * 6).reshape(1, 3, 6, 6)
    return (ramp,)


@pytest.mark.parametrize(("nhwc", "alpha"), [(True, 0.5), (False, -1.7)], ids=["nhwc", "nchw"])
def test_alpha_folds_into_one_table_bit_identically(nhwc, alpha):
    module = TanhOfScaled(alpha, nhwc).eval()
    samples = _inputs()
    program = quantize_for_tosa(module, samples[0], calibration=samples[1:])
    unfolded, folded, decisions = lower_tosa_without_and_with_passes(
        program, before={InsertTableOpsPass: [FoldDyTAlphaIntoLUTPass()]}
    )
    assert [(d.fold, d.applied) for d in decisions] == [(FOLD, True)]
    before, after = unfolded.operator_counts(), folded.operator_counts()
    assert (before["MUL"], before["TABLE"]) == (1, 1)
    assert (after["MUL"], after["TABLE"]) == (0, 1)
    assert after["RESCALE"] == before["RESCALE"] - 3  # activation, alpha and product rescales
    for sample in [*samples, _sweep()]:
        assert torch.equal(unfolded.run(*sample).codes[0], folded.run(*sample).codes[0])


@functools.cache
def _snapshot(kind):
    """The program as the alpha pass sees it (right before InsertTableOpsPass)."""
    module = {"nhwc": TanhOfScaled, "two_users": TanhAndProduct, "vector": TanhOfTensorProduct}[
        kind
    ]
    samples = _inputs()
    program = quantize_for_tosa(module().eval(), samples[0], calibration=samples[1:])
    return program_at(program, capture_before=InsertTableOpsPass)


def _probe(kind, mutate=None):
    snapshot = _snapshot(kind)
    with collect_decisions() as decisions:
        before, after, _ = run_pass_on(snapshot, FoldDyTAlphaIntoLUTPass(), mutate)
    assert after == before
    return decisions


def _only_decline(decisions):
    assert [(d.fold, d.applied) for d in decisions] == [(FOLD, False)]
    return decisions[0].detail


def _node(graph_module, target_fragment):
    return next(n for n in graph_module.graph.nodes if target_fragment in str(n.target))


def test_declines_when_tanh_is_not_int8_per_tensor():
    def drop_output_qparams(graph_module, _):
        _node(graph_module, "aten.tanh").meta["output_qparams"] = {}

    decisions = _probe("nhwc", drop_output_qparams)
    assert "int8 per-tensor" in _only_decline(decisions)


class TanhAndProduct(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.alpha = torch.nn.Parameter(torch.tensor([0.5]))

    def forward(self, x):
        scaled = self.alpha * x.permute(0, 2, 3, 1)
        return torch.tanh(scaled), scaled


def test_declines_when_product_feeds_more_than_tanh():
    decisions = _probe("two_users")
    assert "other than the tanh" in _only_decline(decisions)


def test_declines_when_requantize_does_not_match_tanh_input():
    def shift_tanh_zero_point(graph_module, _):
        tanh = _node(graph_module, "aten.tanh")
        qargs = tanh.meta["input_qparams"][0]
        tanh.meta["input_qparams"] = {0: qargs._replace(zp=qargs.zp + 1)}

    decisions = _probe("nhwc", shift_tanh_zero_point)
    assert "not the tanh's int8 input" in _only_decline(decisions)


class TanhOfTensorProduct(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.alpha = torch.nn.Parameter(torch.linspace(0.2, 1.0, 3))

    def forward(self, x):
        return torch.tanh(self.alpha * x.permute(0, 2, 3, 1))


def test_declines_when_alpha_is_not_a_scalar_constant():
    decisions = _probe("vector")
    assert "scalar int8 constant" in _only_decline(decisions)


def test_declines_when_activation_is_not_a_plain_rescale():
    def view_the_activation(graph_module, _):
        mul = _node(graph_module, "aten.mul.Tensor")
        activation = next(a for a in mul.args if "view_copy" not in str(a.target))
        with graph_module.graph.inserting_before(mul):
            reshaped = graph_module.graph.call_function(
                exir_ops.edge.aten.view_copy.default,
                (activation, list(activation.meta["val"].shape)),
            )
        reshaped.meta = dict(activation.meta)
        mul.replace_input_with(activation, reshaped)

    decisions = _probe("nhwc", view_the_activation)
    assert "plain int8->int32 RESCALE" in _only_decline(decisions)


def test_declines_when_activation_zero_point_disagrees_with_producer():
    def shift_producer_zero_point(graph_module, _):
        permute = _node(graph_module, "permute_copy")
        qargs = permute.meta["output_qparams"][0]
        permute.meta["output_qparams"] = {0: qargs._replace(zp=qargs.zp + 3)}

    decisions = _probe("nhwc", shift_producer_zero_point)
    assert "disagrees with its producer" in _only_decline(decisions)


def test_declines_when_product_overflows_int32():
    def huge_alpha_rescale(graph_module, _):
        mul = _node(graph_module, "aten.mul.Tensor")
        view = next(a for a in mul.args if "view_copy" in str(a.target))
        rescale = view.args[0]
        rescale.args = (*rescale.args[:2], [2.0**28], *rescale.args[3:])

    decisions = _probe("nhwc", huge_alpha_rescale)
    assert "overflows" in _only_decline(decisions)


class ResidualTanh(torch.nn.Module):
    """x + tanh(alpha * x): the activation is read by the residual add too."""

    def __init__(self):
        super().__init__()
        self.alpha = torch.nn.Parameter(torch.tensor([0.5]))

    def forward(self, x):
        return x + torch.tanh(self.alpha * x)


def test_declines_when_the_table_would_lose_its_fused_producer_on_ethos_u():
    pytest.importorskip("ethosu.vela")
    from etfold.backends.arm import arm_folds_registered
    from etfold.harness.vela import U85, lower_module_ethos_u

    samples = _inputs()
    with arm_folds_registered(), collect_decisions() as decisions:
        lower_module_ethos_u(ResidualTanh().eval(), samples[0], U85, calibration=samples[1:])
    assert f"on {U85} the TABLE is free" in _only_decline(decisions)
    program = quantize_for_tosa(ResidualTanh().eval(), samples[0], calibration=samples[1:])
    with collect_decisions() as decisions:
        lower_tosa_with_passes(program, before={InsertTableOpsPass: [FoldDyTAlphaIntoLUTPass()]})
    assert [(d.fold, d.applied) for d in decisions] == [(FOLD, True)]
