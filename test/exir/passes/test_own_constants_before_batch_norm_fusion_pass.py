# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Layers a batch norm fuses into get constants of their own, on every path.

Stock ExecuTorch fuses conv/linear + batch norm into the first sharer's values
on XNNPACK, TOSA FP and (through torchao's prepare_pt2e) TOSA INT. Through
etfold's entry points each model here matches eager: XNNPACK and TOSA FP within
1e-5 relative; TOSA INT as well as the same model with unshared weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from etfold.backends.arm import arm_folds_registered
from etfold.backends.arm._passes import fold_batch_norm_into_linear_pass as linear_fold
from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.exir.passes.own_constants_before_batch_norm_fusion_pass import (
    FOLD,
    own_constants_before_batch_norm_fusion,
    own_constants_in_graph_module,
)
from etfold.harness.tosa_runner import FP, INT, lower_module_tosa
from etfold.harness.xnnpack_runner import lower_module_xnnpack

CONV2D = torch.ops.aten.conv2d.default
LAYERS = {
    "conv": (lambda: nn.Conv2d(4, 6, 3, padding=1), (1, 4, 6, 6), 2),
    "depthwise": (lambda: nn.Conv2d(6, 6, 3, padding=1, groups=6), (1, 6, 6, 6), 2),
    "transposed": (lambda: nn.ConvTranspose2d(4, 6, 2, stride=2), (1, 4, 5, 5), 2),
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, padding=1), (1, 4, 9), 1),
    "linear": (lambda: nn.Linear(4, 6), (5, 4), 1),
}


def _batch_norm(channels: int, rank: int) -> nn.Module:
    norm = nn.BatchNorm2d(channels) if rank == 2 else nn.BatchNorm1d(channels)
    with torch.no_grad():
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
        norm.weight.uniform_(0.5, 2)
        norm.bias.uniform_(-1, 1)
    return norm


class SharedLayers(nn.Module):
    """`sharers` layers, each followed by its own batch norm, sharing `shared` (weight,
    bias or nothing); outputs returned apart or summed."""

    def __init__(self, kind="conv", sharers=2, shared="weight", summed=False):
        super().__init__()
        make, _, rank = LAYERS[kind]
        self.layers = nn.ModuleList(make() for _ in range(sharers))
        for layer in self.layers[1:]:
            if shared is not None:
                setattr(layer, shared, getattr(self.layers[0], shared))
        self.norms = nn.ModuleList(_batch_norm(6, rank) for _ in range(sharers))
        self.summed = summed

    def forward(self, x):
        outputs = [norm(layer(x)) for layer, norm in zip(self.layers, self.norms, strict=True)]
        return sum(outputs) if self.summed else tuple(outputs)


def _unshared_twin(model: SharedLayers) -> SharedLayers:
    """The same values, each layer with tensors of its own."""
    twin = copy.deepcopy(model)
    for layer in twin.layers:
        for name in ("weight", "bias"):
            setattr(layer, name, nn.Parameter(getattr(layer, name).detach().clone()))
    return twin


def _model(kind="conv", **kwargs):
    torch.manual_seed(0)
    model = SharedLayers(kind, **kwargs).eval()
    x = torch.randn(*LAYERS[kind][1])
    return model, x


def _relative_error(actual, reference) -> float:
    scale = max(float(r.abs().max()) for r in reference)
    return max(float((a - r).abs().max()) for a, r in zip(actual, reference, strict=True)) / scale


NEIGHBOURS = [
    pytest.param("conv", {}, id="conv_shared_weight"),
    pytest.param("conv", {"summed": True}, id="conv_summed"),
    pytest.param("depthwise", {}, id="depthwise"),
    pytest.param("transposed", {}, id="transposed"),
    pytest.param("conv1d", {}, id="conv1d"),
    pytest.param("linear", {}, id="linear"),
    pytest.param("conv", {"sharers": 3}, id="three_sharers"),
    pytest.param("conv", {"shared": "bias"}, id="shared_bias_only"),
]


def _neighbours(long: set[str]) -> list:
    """NEIGHBOURS, those named in `long` in `make test-long` only."""
    return [
        pytest.param(*p.values, id=p.id, marks=[pytest.mark.long] if p.id in long else [])
        for p in NEIGHBOURS
    ]


# Each layer op (conv, transposed conv, conv1d, linear) on each backend, which fuses its batch
# norms its own way; the variants (summed, three sharers, a shared bias, depthwise groups) on
# one backend in `make test` and the other in `make test-long`: the pass owning the constants
# is backend-neutral.
XNNPACK_NEIGHBOURS = _neighbours({"depthwise", "three_sharers"})
TOSA_FP_NEIGHBOURS = _neighbours({"conv_summed", "shared_bias_only"})


@pytest.mark.parametrize("kind, kwargs", XNNPACK_NEIGHBOURS)
def test_xnnpack_matches_eager(kind, kwargs):
    model, x = _model(kind, **kwargs)
    with collect_decisions() as decisions:
        program, reference = lower_module_xnnpack(
            model, (x,), [XnnpackPartitioner()], lower=to_edge_transform_and_lower
        )
    assert _relative_error(program.run(x), reference) <= 1e-5
    applied = [d for d in decisions if d.fold == FOLD and d.applied]
    assert len(applied) == kwargs.get("sharers", 2) - 1
    assert program.delegates() == 1


def test_xnnpack_upstream_entry_point_with_etfolds_partitioner_matches_eager():
    model, x = _model()
    program, reference = lower_module_xnnpack(model, (x,), [XnnpackPartitioner()])
    assert _relative_error(program.run(x), reference) <= 1e-5


@pytest.mark.parametrize("kind, kwargs", TOSA_FP_NEIGHBOURS)
def test_tosa_fp_matches_eager(kind, kwargs):
    model, x = _model(kind, **kwargs)
    with arm_folds_registered():
        program, reference = lower_module_tosa(model, (x,), FP)
    assert _relative_error(program.run(x).outputs, reference) <= 1e-5
    assert program.ops_outside() == {} or set(program.ops_outside()) <= {"getitem"}


@pytest.mark.parametrize(
    "kind, kwargs", [NEIGHBOURS[0], NEIGHBOURS[3], NEIGHBOURS[5], NEIGHBOURS[7]]
)
def test_tosa_int_is_as_good_as_the_unshared_model(kind, kwargs):
    model, x = _model(kind, **kwargs)
    calibration = [(torch.randn_like(x),) for _ in range(6)]
    errors = []
    for candidate in (model, _unshared_twin(model)):
        with arm_folds_registered():
            program, reference = lower_module_tosa(candidate, (x,), INT, calibration=calibration)
        errors.append(_relative_error(program.run(x).outputs, reference))
    shared, unshared = errors
    assert unshared < 0.05  # int8 rounding, not a wrong program
    assert shared <= unshared * 1.01 + 1e-6


class ConvReadTwice(nn.Module):
    """A conv read by its batch norm and by an add: torchao fuses it anyway."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.norm = _batch_norm(4, 2)

    def forward(self, x):
        y = self.conv(x)
        return self.norm(y) + y


def test_tosa_int_layer_read_besides_its_batch_norm_matches_eager():
    torch.manual_seed(0)
    model, x = ConvReadTwice().eval(), torch.randn(1, 4, 6, 6)
    calibration = [(torch.randn_like(x),) for _ in range(6)]
    with arm_folds_registered():
        program, reference = lower_module_tosa(model, (x,), INT, calibration=calibration)
    assert _relative_error(program.run(x).outputs, reference) < 0.05


def test_graph_module_layer_read_twice_gets_a_layer_of_its_own():
    torch.manual_seed(0)
    graph_module = torch.export.export(ConvReadTwice().eval(), (torch.randn(1, 4, 6, 6),)).module()
    convs_before = graph_module.graph.find_nodes(op="call_function", target=CONV2D)
    assert own_constants_in_graph_module(graph_module)
    convs = graph_module.graph.find_nodes(op="call_function", target=CONV2D)
    assert len(convs) == len(convs_before) + 1
    assert len({conv.args[1].target for conv in convs}) == 2


def test_the_users_program_is_only_read():
    model, x = _model()
    program = torch.export.export(model, (x,))
    before = (str(program.graph), sorted(program.state_dict))
    rewritten = own_constants_before_batch_norm_fusion(program)
    assert rewritten is not program
    assert (str(program.graph), sorted(program.state_dict)) == before


def test_unshared_program_comes_back_as_is():
    model, x = _model(shared=None)
    program = torch.export.export(model, (x,))
    assert own_constants_before_batch_norm_fusion(program) is program


def test_last_sharer_keeps_the_original_and_no_constant_is_left_unread():
    model, x = _model(sharers=3)
    rewritten = own_constants_before_batch_norm_fusion(torch.export.export(model, (x,)))
    weights = [
        n.args[1] for n in rewritten.graph.nodes if n.target == torch.ops.aten.conv2d.default
    ]
    assert len(set(weights)) == 3
    assert all(len(weight.users) == 1 for weight in weights)


def test_linear_fold_declines_a_linear_read_elsewhere():
    class LinearReadTwice(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.norm = nn.Linear(4, 6), _batch_norm(6, 1)

        def forward(self, x):
            y = self.linear(x)
            return self.norm(y), y

    program = torch.export.export(LinearReadTwice().eval(), (torch.randn(5, 4),))
    with collect_decisions() as decisions:
        assert linear_fold.fold_batch_norms_into_linears(program) is program
    (declined,) = [d for d in decisions if d.fold == linear_fold.FOLD]
    assert not declined.applied and "read by more than the batch norm" in declined.detail
