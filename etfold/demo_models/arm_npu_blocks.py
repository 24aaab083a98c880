# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Real-architecture blocks for the Arm folds on Ethos-U (random weights, small).

- `LayerScaleConvNeXtBlock`: ConvNeXt's block as timm writes it: depthwise
  conv, permute to channels-last, LayerNorm, Linear MLP, `Dropout(0.)`, the
  LayerScale multiply by a per-channel gamma, permute back, residual.
- `DyTViTBlock`: a pre-norm ViT block (DeiT-III / CaiT / DINOv2 style) with DyT
  in place of LayerNorm and LayerScale after the attention projection and the
  MLP (each behind a `Dropout(0.)`, as timm's blocks put it).
- `BNFreeConvNet`: convs scaled by per-channel and scalar constants (no
  BatchNorm to fold into), a transposed conv upsampler with a per-channel scale,
  and two convs sharing one weight with different scales.
- `GRUConvCell`: a convolutional GRU-like cell whose hidden state lives in a
  buffer: two scaled gate convs upstream of the state, written back each call.
"""

from __future__ import annotations

import torch

from etfold.demo_models.arm_dyt import DyT, randomize_affine
from etfold.demo_models.base import DemoModel


class LayerScaleConvNeXtBlock(torch.nn.Module):
    def __init__(self, channels: int = 16, expansion: int = 2, layer_scale: float = 0.5):
        super().__init__()
        self.dwconv = torch.nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
        self.norm = torch.nn.LayerNorm(channels)
        self.fc1 = torch.nn.Linear(channels, expansion * channels)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(expansion * channels, channels)
        self.drop = torch.nn.Dropout(0.0)
        self.gamma = torch.nn.Parameter(layer_scale * torch.linspace(0.5, 1.5, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.drop(self.fc2(self.act(self.fc1(self.norm(y)))))
        y = y.mul(self.gamma).permute(0, 3, 1, 2)
        return x + y


class Attention(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.proj_drop = torch.nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attention = (q @ k.transpose(-2, -1)) * (dim // self.heads) ** -0.5
        y = (attention.softmax(dim=-1) @ v).transpose(1, 2).reshape(batch, tokens, dim)
        return self.proj_drop(self.proj(y))


class LayerScale(torch.nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.gamma = torch.nn.Parameter(init * torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class DyTViTBlock(torch.nn.Module):
    def __init__(self, dim: int = 32, heads: int = 2, expansion: int = 2, init: float = 0.1):
        super().__init__()
        self.norm1 = DyT(dim, nhwc=True)
        self.attn = Attention(dim, heads)
        self.ls1 = LayerScale(dim, init)
        self.norm2 = DyT(dim, nhwc=True)
        self.fc1 = torch.nn.Linear(dim, expansion * dim)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(expansion * dim, dim)
        self.drop = torch.nn.Dropout(0.0)
        self.ls2 = LayerScale(dim, init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.drop(self.fc2(self.act(self.fc1(self.norm2(x))))))


class BNFreeConvNet(torch.nn.Module):
    def __init__(self, channels: int = 8):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, channels, 3, padding=1)
        self.register_buffer("stem_scale", torch.linspace(0.5, 2.0, channels).reshape(1, -1, 1, 1))
        self.down = torch.nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1)
        self.up = torch.nn.ConvTranspose2d(2 * channels, channels, 2, stride=2)
        self.register_buffer("up_scale", torch.linspace(0.3, 3.0, channels).reshape(1, -1, 1, 1))
        self.left = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.right = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.right.weight = self.left.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x) * self.stem_scale)
        y = torch.relu(self.up(torch.relu(self.down(y))) * self.up_scale) + y
        return self.left(y) * 0.5 + self.right(y) * 2.0


class GRUConvCell(torch.nn.Module):
    """h <- h + z * (n - h), z = sigmoid(conv_z([x, h]) * s_z), n = tanh(conv_n([x, h]) * s_n)."""

    def __init__(self, channels: int = 4, size: int = 8):
        super().__init__()
        self.conv_z = torch.nn.Conv2d(2 * channels, channels, 3, padding=1)
        self.conv_n = torch.nn.Conv2d(2 * channels, channels, 3, padding=1)
        self.register_buffer("scale_z", torch.linspace(0.5, 1.5, channels).reshape(1, -1, 1, 1))
        self.register_buffer("h", torch.zeros(1, channels, size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xh = torch.cat([x, self.h], dim=1)
        z = torch.sigmoid(self.conv_z(xh) * self.scale_z)
        n = torch.tanh(self.conv_n(xh) * 0.5)
        h = self.h + z * (n - self.h)
        self.h.copy_(h)
        return h


def _seeded(make, *shape):
    def build():
        torch.manual_seed(0)
        module = make().eval()
        for dyt in (m for m in module.modules() if isinstance(m, DyT)):
            randomize_affine(dyt, torch.Generator().manual_seed(1))
        return module, (torch.randn(*shape),)

    def calibration():
        generator = torch.Generator().manual_seed(2)
        return [(torch.randn(*shape, generator=generator),) for _ in range(4)]

    return build, calibration


CONVNEXT = _seeded(LayerScaleConvNeXtBlock, 1, 16, 8, 8)
VIT = _seeded(DyTViTBlock, 1, 16, 32)
BN_FREE = _seeded(BNFreeConvNet, 1, 3, 16, 16)
GRU = _seeded(GRUConvCell, 1, 4, 8, 8)

MODELS = [
    DemoModel(
        "convnext_layerscale_block",
        "arm",
        CONVNEXT[0],
        "ConvNeXt block (LayerNorm, Linear MLP, Dropout(0.), LayerScale, permutes), TOSA INT",
        calibration=CONVNEXT[1],
    ),
    DemoModel(
        "vit_dyt_layerscale_block",
        "arm",
        VIT[0],
        "ViT block with DyT for LayerNorm and LayerScale after attention and MLP, TOSA INT",
        calibration=VIT[1],
    ),
    DemoModel(
        "bn_free_conv_net",
        "arm",
        BN_FREE[0],
        "BN-free convs with per-channel/scalar scales, a scaled transposed conv, a shared weight",
        calibration=BN_FREE[1],
    ),
    DemoModel(
        "gru_conv_cell",
        "arm",
        GRU[0],
        "conv GRU-like cell, hidden state in a buffer, scaled gate convs upstream of it",
        calibration=GRU[1],
    ),
]
