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
- `ScaledConvForms`: a BN-free conv net scaling its convs the ways users write
  it (a number, a per-channel Parameter, a scalar buffer on the left, one conv
  called twice with two scales, a scaled transposed-conv upsampler before a max
  pool), plus two sites that must decline (a spatial scale, a second reader).
- `ConvNeXtAtto`: timm's ConvNeXt at atto widths with depths (1, 1, 1, 1) and
  LayerScale gammas of spread magnitudes, a fifth of them negative.
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


class ScaledConvForms(torch.nn.Module):
    def __init__(self, channels: int = 16, size: int = 16):
        super().__init__()
        conv = lambda: torch.nn.Conv2d(channels, channels, 3, padding=1)  # noqa: E731
        self.stem = torch.nn.Conv2d(3, channels, 3, padding=1)
        self.c1, self.c2, self.shared, self.c3, self.c4 = conv(), conv(), conv(), conv(), conv()
        self.s1 = torch.nn.Parameter(torch.linspace(0.5, 1.5, channels).reshape(1, -1, 1, 1))
        self.register_buffer("s2", torch.tensor(0.75))
        self.up = torch.nn.ConvTranspose2d(channels, channels, 2, stride=2)
        self.sup = torch.nn.Parameter(torch.linspace(0.3, 3.0, channels).reshape(1, -1, 1, 1))
        spatial = torch.linspace(0.5, 1.5, size * size).reshape(1, 1, size, size)
        self.register_buffer("spatial", spatial)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x) * 0.5)
        y = torch.relu(self.c1(y) * self.s1)
        y = self.s2 * self.c2(y)
        y = self.shared(y) * 0.25 + self.shared(y) * 2.0
        y = y + torch.nn.functional.max_pool2d(self.up(y) * self.sup, 2)
        y = self.c3(y) * self.spatial
        z = self.c4(y)
        return z * 1.5 + z


class LayerNorm2d(torch.nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor (timm's, for ConvNeXt's stem and downsamples)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.layer_norm(
            x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps
        )
        return y.permute(0, 3, 1, 2)


class ConvNeXtAttoBlock(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv_dw = torch.nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = torch.nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(4 * dim, dim)
        self.gamma = torch.nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(self.act(self.fc1(self.norm(self.conv_dw(x).permute(0, 2, 3, 1)))))
        return x + y.mul(self.gamma).permute(0, 3, 1, 2)


class ConvNeXtAtto(torch.nn.Module):
    def __init__(self, dims=(40, 80, 160, 320), classes: int = 1000):
        super().__init__()
        self.stem = torch.nn.Sequential(
            torch.nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0], eps=1e-6)
        )
        stages = [ConvNeXtAttoBlock(dims[0])]
        for before, dim in zip(dims, dims[1:], strict=False):
            down = [LayerNorm2d(before, eps=1e-6), torch.nn.Conv2d(before, dim, 2, stride=2)]
            stages.append(torch.nn.Sequential(*down, ConvNeXtAttoBlock(dim)))
        self.stages = torch.nn.Sequential(*stages)
        self.norm = torch.nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = torch.nn.Linear(dims[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.stages(self.stem(x)).mean((2, 3))))


def randomize_layer_scales(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Trained LayerScale gammas: magnitudes spread over e^-3..e^1, a fifth negative."""
    for block in module.modules():
        if isinstance(block, ConvNeXtAttoBlock):
            shape = block.gamma.shape
            magnitude = torch.empty(shape).uniform_(-3.0, 1.0, generator=generator).exp()
            sign = torch.where(torch.rand(shape, generator=generator) < 0.2, -1.0, 1.0)
            block.gamma.data = magnitude * sign


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
        randomize_layer_scales(module, torch.Generator().manual_seed(1))
        return module, (torch.randn(*shape),)

    def calibration():
        generator = torch.Generator().manual_seed(2)
        return [(torch.randn(*shape, generator=generator),) for _ in range(4)]

    return build, calibration


CONVNEXT = _seeded(LayerScaleConvNeXtBlock, 1, 16, 8, 8)
VIT = _seeded(DyTViTBlock, 1, 16, 32)
BN_FREE = _seeded(BNFreeConvNet, 1, 3, 16, 16)
GRU = _seeded(GRUConvCell, 1, 4, 8, 8)
SCALED_FORMS = _seeded(ScaledConvForms, 1, 3, 16, 16)
CONVNEXT_ATTO = _seeded(ConvNeXtAtto, 1, 3, 64, 64)

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
        "scaled_conv_forms",
        "arm",
        SCALED_FORMS[0],
        "BN-free convs scaled the ways users write it, a scaled transposed-conv upsampler",
        calibration=SCALED_FORMS[1],
    ),
    DemoModel(
        "convnext_atto_layerscale",
        "arm",
        CONVNEXT_ATTO[0],
        "timm ConvNeXt, atto widths, depths (1,1,1,1), trained-like LayerScale gammas",
        calibration=CONVNEXT_ATTO[1],
    ),
    DemoModel(
        "gru_conv_cell",
        "arm",
        GRU[0],
        "conv GRU-like cell, hidden state in a buffer, scaled gate convs upstream of it",
        calibration=GRU[1],
    ),
]
