# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Baseline models: nothing to fold, so stock and etfold must agree."""

from __future__ import annotations

import torch

from etfold.demo_models.base import DemoModel


class ConvBlock(torch.nn.Module):
    def __init__(self, channels_in: int = 3, channels_out: int = 16):
        super().__init__()
        self.conv = torch.nn.Conv2d(channels_in, channels_out, 3, padding=1)
        self.act = torch.nn.ReLU()
        self.head = torch.nn.Conv2d(channels_out, channels_out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.conv(x)))


class Mlp(torch.nn.Module):
    def __init__(self, width: int = 128):
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class DepthwiseSeparable(torch.nn.Module):
    def __init__(self, channels: int = 32):
        super().__init__()
        self.depthwise = torch.nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
        self.pointwise = torch.nn.Conv2d(channels, 2 * channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.hardswish(self.pointwise(self.depthwise(x)))


def _depthwise_separable():
    torch.manual_seed(0)
    return DepthwiseSeparable().eval(), (torch.randn(1, 32, 28, 28),)


def _conv_block():
    torch.manual_seed(0)
    return ConvBlock().eval(), (torch.randn(1, 3, 32, 32),)


def _mlp():
    torch.manual_seed(0)
    return Mlp().eval(), (torch.randn(4, 128),)


def _conv_block_small():
    torch.manual_seed(0)
    return ConvBlock(3, 8).eval(), (torch.randn(1, 3, 16, 16),)


MODELS = [
    DemoModel("conv_block", "xnnpack", _conv_block, "conv-relu-conv, nothing to fold"),
    DemoModel("mlp", "xnnpack", _mlp, "linear-gelu-linear, nothing to fold"),
    DemoModel(
        "depthwise_separable",
        "xnnpack",
        _depthwise_separable,
        "depthwise + pointwise conv, nothing to fold",
    ),
    DemoModel(
        "conv_block_int8", "arm", _conv_block_small, "conv-relu-conv on TOSA INT, nothing to fold"
    ),
]
