# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.


"""Generated XNNPACK dtype-convert cases: chains of fp32/bf16/fp16 regions joined by casts,
for the dtype-convert delegation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from etfold.harness.generated_cases import DTYPES, Built, Call, randn, seeded_generator


@dataclass(frozen=True)
class ConvertRegion:
    dtype: str  # a key of DTYPES: the region computes in it
    op: str  # a key of REGION_OPS
    channels_last: bool = False  # the cast into this region also sets channels-last


@dataclass(frozen=True)
class ConvertsCase:
    seed: int
    channels: int
    size: tuple[int, int]
    model_dtype: str  # the input's and output's dtype
    regions: tuple[ConvertRegion, ...]

    family = "converts"


REGION_OPS = (
    "conv",
    "linear",
    "gelu",
    "norm_in_fp32",  # layer norm computed in fp32, then cast back to the region dtype
    "const_cast",  # a constant cast to the region dtype at runtime
    "softmax_last",
    "add_residual",
)


class _Region(nn.Module):
    def __init__(self, spec: ConvertRegion, channels: int, width: int):
        super().__init__()
        self.spec = spec
        dtype = DTYPES[spec.dtype]
        if spec.op == "conv":
            self.conv = nn.Conv2d(channels, channels, 3, padding=1).to(dtype)
        elif spec.op == "linear":
            self.linear = nn.Linear(width, width).to(dtype)
        elif spec.op == "norm_in_fp32":
            self.norm = nn.LayerNorm(width)
        elif spec.op == "const_cast":
            self.register_buffer("constant", torch.linspace(-1.0, 1.0, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec, dtype = self.spec, DTYPES[self.spec.dtype]
        if spec.channels_last:
            x = x.to(dtype=dtype, memory_format=torch.channels_last)
        else:
            x = x.to(dtype)
        if spec.op == "conv":
            return self.conv(x)
        if spec.op == "linear":
            return self.linear(x)
        if spec.op == "gelu":
            return F.gelu(x)
        if spec.op == "norm_in_fp32":
            return self.norm(x.float()).to(dtype)
        if spec.op == "const_cast":
            return x * self.constant.to(dtype)
        if spec.op == "softmax_last":
            return torch.softmax(x.float(), dim=-1).to(dtype)
        return x + 0.5 * torch.tanh(x)


class RegionChain(nn.Module):
    def __init__(self, case: ConvertsCase):
        super().__init__()
        self.case = case
        width = case.size[1]
        self.regions = nn.ModuleList(_Region(r, case.channels, width) for r in case.regions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for region in self.regions:
            x = region(x)
        return x.to(DTYPES[self.case.model_dtype])


def build_converts(case: ConvertsCase) -> Built:
    torch.manual_seed(case.seed)
    module = RegionChain(case).eval()
    generator = seeded_generator(case.seed + 1)
    shape = (1, case.channels, *case.size)
    samples = [(randn(generator, *shape).to(DTYPES[case.model_dtype]),) for _ in range(2)]
    return Built(module, {"forward": samples[0]}, [Call("forward", s) for s in samples])
