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


class ConvScaleNet(torch.nn.Module):
    """Convs scaled every way a BN-free net writes it: a number, a per-channel Parameter,
    a scalar buffer on the left, one conv called twice with two scales whose results
    add, a per-channel scale after a transposed conv before a max pool, a spatial
    scale (must decline) and a conv whose output two ops read."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, c, 3, padding=1)
        self.c1 = torch.nn.Conv2d(c, c, 3, padding=1)
        self.s1 = torch.nn.Parameter(torch.linspace(0.3, 1.7, c).reshape(1, c, 1, 1))
        self.c2 = torch.nn.Conv2d(c, c, 1)
        self.register_buffer("s2", torch.tensor(0.75))
        self.shared = torch.nn.Conv2d(c, c, 3, padding=1)
        self.up = torch.nn.ConvTranspose2d(c, c, 2, stride=2)
        self.sup = torch.nn.Parameter(torch.linspace(1.5, 0.5, c).reshape(1, c, 1, 1))
        self.spatial = torch.nn.Conv2d(c, c, 1)
        spatial_scale = torch.linspace(0.5, 1.5, 16).reshape(1, 1, 1, 16)
        self.register_buffer("spatial_scale", spatial_scale)
        self.two_users = torch.nn.Conv2d(c, c, 1)
        self.head = torch.nn.Conv2d(c, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x) * 0.5)
        y = torch.relu(self.c1(y) * self.s1)
        y = self.s2 * self.c2(y)
        a = self.shared(y) * 0.25
        b = self.shared(y) * 2.0
        y = torch.relu(a + b)
        u = self.up(y) * self.sup
        u = torch.nn.functional.max_pool2d(u, 2)
        z = self.spatial(u) * self.spatial_scale
        t = self.two_users(z)
        z = t * 0.5 + t
        return self.head(torch.relu(z))


def random_channel_scales(module: ConvScaleNet, seed: int) -> ConvScaleNet:
    """`module` with its per-channel scales (s1, sup) redrawn: magnitudes uniform in
    [0.25, 2], a fifth of the channels negative."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for scale in (module.s1, module.sup):
            magnitude = 0.25 + 1.75 * torch.rand(scale.shape, generator=generator)
            negative = torch.rand(scale.shape, generator=generator) < 0.2
            scale.copy_(torch.where(negative, -magnitude, magnitude))
    return module


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


def _conv_scale_net(scale_seed: int | None):
    """ConvScaleNet with PyTorch's default init under seed 7 (as the model was given), its
    per-channel scales redrawn when `scale_seed` is set; input and five calibration samples
    (six calibration inputs in all) drawn from their own seeded generators."""

    def build():
        torch.manual_seed(7)
        module = ConvScaleNet().eval()
        if scale_seed is not None:
            random_channel_scales(module, scale_seed)
        return module, (torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0)),)

    def calibration():
        generator = torch.Generator().manual_seed(1)
        return [(torch.randn(1, 3, 16, 16, generator=generator),) for _ in range(5)]

    return build, calibration


CONV_SCALE_NET = _conv_scale_net(None)
CONV_SCALE_NET_SCALES = {seed: _conv_scale_net(seed) for seed in (1, 2, 3)}

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
    DemoModel(
        "conv_scale_net",
        "arm",
        CONV_SCALE_NET[0],
        "BN-free conv net scaled every way (twin convs, a scaled transposed conv), seed 7",
        calibration=CONV_SCALE_NET[1],
    ),
    DemoModel(
        "conv_scale_net_scales_seed1",
        "arm",
        CONV_SCALE_NET_SCALES[1][0],
        "conv_scale_net with random per-channel scales in [0.25, 2], a fifth negative (seed 1)",
        calibration=CONV_SCALE_NET_SCALES[1][1],
    ),
    DemoModel(
        "conv_scale_net_scales_seed2",
        "arm",
        CONV_SCALE_NET_SCALES[2][0],
        "conv_scale_net with random per-channel scales in [0.25, 2], a fifth negative (seed 2)",
        calibration=CONV_SCALE_NET_SCALES[2][1],
    ),
    DemoModel(
        "conv_scale_net_scales_seed3",
        "arm",
        CONV_SCALE_NET_SCALES[3][0],
        "conv_scale_net with random per-channel scales in [0.25, 2], a fifth negative (seed 3)",
        calibration=CONV_SCALE_NET_SCALES[3][1],
    ),
]
