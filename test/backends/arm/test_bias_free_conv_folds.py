# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""DyT before a conv that has no bias, through the whole quantized flow.

The float DyT fold gives such a conv a bias. The conv must keep the argument
form torch's export gives it (the bias by position), or the PT2E quantizer's
annotation asserts on a tensor passed by keyword. Each conv kind is quantized
with TOSAQuantizer (INT, symmetric, per-channel), lowered with and without
etfold's folds, run on the TOSA reference model and judged against the stock
lowering (`etfold.harness.int_judge`). The Ethos-U lowering of the same model
goes through Vela.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from etfold.backends.arm import arm_folds_registered
from etfold.backends.arm._passes.fold_dyt_affine_into_conv_float_pass import FOLD
from etfold.decisions import collect_decisions
from etfold.harness.differential_arm import differential_arm
from etfold.harness.generated_cases import Built, Call

# kind -> (layer without bias, input shape, whether the float DyT fold applies)
_LAYERS = {
    "plain": (lambda: nn.Conv2d(4, 8, 3, bias=False), (1, 4, 6, 6), True),
    "padded": (lambda: nn.Conv2d(4, 8, 3, padding=1, bias=False), (1, 4, 6, 6), True),
    "depthwise": (lambda: nn.Conv2d(4, 4, 3, groups=4, bias=False), (1, 4, 6, 6), True),
    "grouped": (lambda: nn.Conv2d(4, 8, 3, groups=2, bias=False), (1, 4, 6, 6), True),
    # a transposed conv's taps overlap unevenly, and only 2-D convs fold: both stay
    "transposed": (
        lambda: nn.ConvTranspose2d(4, 8, 2, stride=2, bias=False),
        (1, 4, 6, 6),
        False,
    ),
    "conv1d": (lambda: nn.Conv1d(4, 8, 3, bias=False), (1, 4, 6), False),
    "linear": (lambda: nn.Linear(4, 8, bias=False), (1, 6, 4), True),
}


class DyTThenLayer(nn.Module):
    """`layer(gamma * tanh(alpha * x) + beta)`, gamma and beta along the layer's channels."""

    def __init__(self, layer: nn.Module, rank: int):
        super().__init__()
        self.layer = layer
        linear = isinstance(layer, nn.Linear)
        shape = (4,) if linear else (4,) + (1,) * (rank - 2)
        self.alpha = nn.Parameter(torch.tensor([0.5]))
        self.gamma = nn.Parameter(torch.tensor([0.9823, -1.0788, 0.8406, 1.0633]).reshape(shape))
        self.beta = nn.Parameter(torch.tensor([0.2602, -0.175, -0.151, 0.135]).reshape(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.tanh(self.alpha * x) * self.gamma + self.beta)


def _built(kind: str) -> Built:
    make_layer, shape, _ = _LAYERS[kind]
    torch.manual_seed(0)
    module = DyTThenLayer(make_layer(), len(shape)).eval()
    generator = torch.Generator().manual_seed(1)
    samples = [(2 * torch.randn(*shape, generator=generator),) for _ in range(4)]
    return Built(module, {"forward": samples[0]}, [Call("forward", samples[0])], samples[1:])


# A depthwise or grouped conv takes its bias in the argument form a plain one does, and their
# weights fold exactly in fp32 (test_fold_dyt_affine_into_conv_float_pass): `make test-long`.
SAME_FORM_AS_PLAIN = {"depthwise", "grouped"}


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(kind, marks=[pytest.mark.long] if kind in SAME_FORM_AS_PLAIN else [])
        for kind in _LAYERS
    ],
)
def test_bias_free_layer_after_dyt_quantizes_and_lowers_within_stock_error(kind):
    outcome = differential_arm(_built(kind))
    assert outcome.verdict == "ok", (outcome.verdict, outcome.detail)
    folds = _LAYERS[kind][2]
    assert [d.applied for d in outcome.journal if d.fold == FOLD] == ([True] if folds else [])
    if folds:  # alpha went into the TABLE, gamma into the weight
        assert outcome.lowered.operator_counts()["MUL"] == 0


def test_bias_free_conv_after_dyt_lowers_for_ethos_u():
    from etfold.harness.vela import U55, lower_module_ethos_u

    built = _built("plain")
    with arm_folds_registered(), collect_decisions() as decisions:
        program = lower_module_ethos_u(
            built.module, built.calls[0].inputs, U55, calibration=built.calibration
        )
    assert [d.applied for d in decisions if d.fold == FOLD] == [True]
    assert program.delegates() == 1
    operators = program.operator_counts()
    assert (operators["MUL"], operators["ADD"], operators["CONV2D"]) == (0, 0, 1)
