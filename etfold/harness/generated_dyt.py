# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.


"""Generated Arm DyT cases: DyT then a conv (layouts, what sits between, gamma and beta),
for the DyT folds."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from etfold.harness.generated_cases import Built, Call, randn, seeded_generator


@dataclass(frozen=True)
class DyTCase:
    seed: int
    channels: int
    out_channels: int
    size: tuple[int, int]
    nhwc: bool
    between: str  # "none", "slice" (first channels only), "permute_back_and_forth"
    conv: str  # a key of etfold.demo_models.arm_dyt.DYT_CONV_KINDS
    gamma: str  # "identity" (ones) or "random"
    beta: str  # "zero" or "random"
    alpha: float
    bias: bool = True  # whether the conv has a bias (DyT often comes before one without)

    family = "dyt"


class DyTThenConv(nn.Module):
    def __init__(self, case: DyTCase, generator: torch.Generator):
        super().__init__()
        from etfold.demo_models.arm_dyt import DYT_CONV_KINDS, DyT

        self.case = case
        self.dyt = DyT(case.channels, nhwc=case.nhwc, alpha=case.alpha)
        with torch.no_grad():
            if case.gamma == "random":
                sign = torch.where(
                    torch.rand(self.dyt.gamma.shape, generator=generator) < 0.2, -1, 1
                )
                self.dyt.gamma.copy_(
                    sign * (0.5 + torch.rand(self.dyt.gamma.shape, generator=generator))
                )
            if case.beta == "random":
                self.dyt.beta.copy_(0.3 * torch.randn(self.dyt.beta.shape, generator=generator))
        kind = DYT_CONV_KINDS[case.conv]
        conv_in = self.conv_in_channels
        depthwise = kind.get("depthwise", False)
        self.conv = nn.Conv2d(
            conv_in,
            conv_in if depthwise else case.out_channels,
            kind["kernel_size"],
            padding=kind.get("padding", 0),
            groups=conv_in if depthwise else 1,
            bias=case.bias,
        )

    @property
    def conv_in_channels(self) -> int:
        return (
            max(1, self.case.channels // 2) if self.case.between == "slice" else self.case.channels
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        case = self.case
        if case.nhwc:
            y = self.dyt(x.permute(0, 2, 3, 1))
            if case.between == "permute_back_and_forth":
                y = y.permute(0, 3, 1, 2).permute(0, 2, 3, 1)
            y = y.permute(0, 3, 1, 2)
        else:
            y = self.dyt(x)
            if case.between == "permute_back_and_forth":
                y = y.permute(0, 2, 3, 1).permute(0, 3, 1, 2)
        if case.between == "slice":
            y = y[:, : self.conv_in_channels]
        return self.conv(y)


def build_dyt(case: DyTCase) -> Built:
    torch.manual_seed(case.seed)
    generator = seeded_generator(case.seed + 1)
    module = DyTThenConv(case, generator).eval()
    shape = (1, case.channels, *case.size)
    samples = [(randn(generator, *shape, scale=2.0),) for _ in range(4)]
    return Built(module, {"forward": samples[0]}, [Call("forward", samples[0])], samples[1:])
