# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""DyT (Dynamic Tanh) blocks on TOSA INT: the alpha, gamma/beta folds' home models.

DyT replaces a normalization layer with `gamma * tanh(alpha * x) + beta`
(per-channel gamma/beta). `DyTConv` is the smallest site: DyT then a conv, in
the NHWC form (ConvNeXt: permute to channels-last, DyT, permute back) or the
NCHW form (gamma/beta shaped [C, 1, 1]). `DyTConvNeXtBlock` is a ConvNeXt-style
block with DyT in place of its LayerNorm.
"""

from __future__ import annotations

import torch

from etfold.demo_models.base import DemoModel


class DyT(torch.nn.Module):
    """gamma * tanh(alpha * x) + beta over the channel axis (last for NHWC, 1 for NCHW)."""

    def __init__(self, channels: int, *, nhwc: bool, alpha: float = 0.5):
        super().__init__()
        self.nhwc = nhwc
        self.alpha = torch.nn.Parameter(torch.tensor([alpha]))
        shape = (channels,) if nhwc else (channels, 1, 1)
        self.gamma = torch.nn.Parameter(torch.ones(shape))
        self.beta = torch.nn.Parameter(torch.zeros(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gamma * torch.tanh(self.alpha * x) + self.beta


class DyTConv(torch.nn.Module):
    """x -> [permute to NHWC] -> DyT -> [permute back] -> conv."""

    def __init__(
        self,
        channels: int = 4,
        out_channels: int = 4,
        *,
        nhwc: bool = True,
        kernel_size: int = 1,
        padding: int = 0,
        depthwise: bool = False,
        alpha: float = 0.5,
    ):
        super().__init__()
        self.nhwc = nhwc
        self.dyt = DyT(channels, nhwc=nhwc, alpha=alpha)
        groups = channels if depthwise else 1
        out_channels = channels if depthwise else out_channels
        self.conv = torch.nn.Conv2d(
            channels, out_channels, kernel_size, padding=padding, groups=groups
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dyt(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2) if self.nhwc else self.dyt(x)
        return self.conv(x)


# The conv shapes a DyT fold must handle, as DyTConv keyword arguments.
DYT_CONV_KINDS = {
    "1x1": dict(kernel_size=1),
    "3x3_padded": dict(kernel_size=3, padding=1),
    "3x3_unpadded": dict(kernel_size=3),
    "dw3x3_padded": dict(kernel_size=3, padding=1, depthwise=True),
    "dw1x1": dict(kernel_size=1, depthwise=True),
}


class DyTConvNeXtBlock(torch.nn.Module):
    """depthwise 3x3 -> NHWC DyT -> 1x1 expand -> GELU -> 1x1 project, plus the residual."""

    def __init__(self, channels: int = 8, expansion: int = 2):
        super().__init__()
        self.dwconv = torch.nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
        self.dyt = DyT(channels, nhwc=True)
        self.expand = torch.nn.Conv2d(channels, expansion * channels, 1)
        self.act = torch.nn.GELU()
        self.project = torch.nn.Conv2d(expansion * channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.dyt(y).permute(0, 3, 1, 2)
        return x + self.project(self.act(self.expand(y)))


def randomize_affine(dyt: DyT, generator: torch.Generator, *, spread: float = 2.0) -> None:
    """Give gamma values in [1/sqrt(spread), sqrt(spread)] (random sign) and beta ~ N(0, 0.2)."""
    with torch.no_grad():
        low, high = spread**-0.5, spread**0.5
        magnitude = low + (high - low) * torch.rand(dyt.gamma.shape, generator=generator)
        sign = torch.where(torch.rand(dyt.gamma.shape, generator=generator) < 0.2, -1.0, 1.0)
        dyt.gamma.copy_(magnitude * sign)
        dyt.beta.copy_(0.2 * torch.randn(dyt.beta.shape, generator=generator))


def _convnext_block():
    torch.manual_seed(0)
    block = DyTConvNeXtBlock().eval()
    randomize_affine(block.dyt, torch.Generator().manual_seed(1))
    return block, (torch.randn(1, 8, 8, 8),)


def _calibration():
    generator = torch.Generator().manual_seed(2)
    return [(torch.randn(1, 8, 8, 8, generator=generator),) for _ in range(4)]


MODELS = [
    DemoModel(
        "dyt_convnext_block",
        "arm",
        _convnext_block,
        "ConvNeXt-style block with DyT (random gamma/beta) before a 1x1 conv, TOSA INT",
        calibration=_calibration,
        default=True,
    ),
]
