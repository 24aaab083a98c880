# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Conv × scale on TOSA INT: where the scalar-mul fold applies, and where it must decline.

`ConvScaleBlock` scales each conv's output by a constant (per-channel, then a
scalar): both scales fold into the conv weights before calibration.
`RecurrentConvCell` writes its scaled conv output into a buffer it reads on the
next call; folding there would change how the carried state is quantized, so
the fold declines with its reason. (Its report error compares one step from the
state calibration left behind with a fresh eager step; read it for stock vs
etfold, not as a parity figure.)
"""

from __future__ import annotations

import torch

from etfold.demo_models.base import DemoModel


class ConvScaleBlock(torch.nn.Module):
    def __init__(self, channels_in: int = 3, channels: int = 8):
        super().__init__()
        self.conv = torch.nn.Conv2d(channels_in, channels, 3, padding=1)
        self.head = torch.nn.Conv2d(channels, channels, 1)
        self.register_buffer(
            "channel_scale", torch.linspace(0.25, 2.0, channels).reshape(1, channels, 1, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x) * self.channel_scale)) * 0.5


class RecurrentConvCell(torch.nn.Module):
    """state <- conv(x + state) * 0.25; returns the new state."""

    def __init__(self, channels: int = 4, size: int = 8):
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.register_buffer("state", torch.zeros(1, channels, size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x + self.state) * 0.25
        self.state.copy_(y)
        return y


def _conv_scale_block():
    torch.manual_seed(0)
    return ConvScaleBlock().eval(), (torch.randn(1, 3, 16, 16),)


def _conv_scale_calibration():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(1, 3, 16, 16, generator=generator),) for _ in range(4)]


def _recurrent_cell():
    torch.manual_seed(0)
    return RecurrentConvCell().eval(), (torch.randn(1, 4, 8, 8),)


MODELS = [
    DemoModel(
        "conv_scale_block_int8",
        "arm",
        _conv_scale_block,
        "conv × per-channel scale, relu, conv × 0.5 on TOSA INT: both scales fold",
        calibration=_conv_scale_calibration,
    ),
    DemoModel(
        "recurrent_conv_cell_int8",
        "arm",
        _recurrent_cell,
        "conv × scale written back to a state buffer on TOSA INT: the fold declines (carried state)",
        default=True,
    ),
]
