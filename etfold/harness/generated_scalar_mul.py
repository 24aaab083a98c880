# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.


"""Generated Arm scalar-mul cases: conv * scale variants (scale shapes and values, shared
weights, carried state, INT and FP), for the scalar-mul fold."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from etfold.harness.generated_cases import Built, Call, randn, same_padding, seeded_generator


@dataclass(frozen=True)
class ScalarMulCase:
    seed: int
    conv: str  # a key of CONV_KINDS
    in_channels: int
    out_channels: int
    size: int  # spatial extent (each spatial dim)
    bias: bool
    scale_kind: str  # "scalar", "per_channel", "spatial" (not along channels), "activation"
    scale_values: str  # a key of SCALE_VALUES
    scale_first: bool = False  # s * conv(x) rather than conv(x) * s
    share: bool = False  # a second conv reads the same weight with another scale
    shared_input: str = "same"  # the second conv reads x ("same": one product twice) or x mirrored
    state: str = "none"  # "none", "buffer" (recurrent state in a buffer), "marked_output"
    profile: str = "INT"  # "INT" or "FP"

    family = "scalar_mul"


# conv kind -> (spatial dims, transposed, groups is depthwise, stride, dilation, grouped)
CONV_KINDS = {
    "conv1d": dict(dims=1),
    "conv2d": dict(dims=2),
    "depthwise": dict(dims=2, depthwise=True),
    "dilated": dict(dims=2, dilation=2),
    "strided": dict(dims=2, stride=2),
    "grouped": dict(dims=2, groups=2),
    "transposed1d": dict(dims=1, transposed=True),
    "transposed2d": dict(dims=2, transposed=True),
}


def _scale_values(kind: str, count: int, generator: torch.Generator) -> torch.Tensor:
    u = torch.rand(count, generator=generator)
    if kind == "tiny":
        return 1e-3 * (1 + u)
    if kind == "huge":
        return 1e2 * (0.5 + u)
    if kind == "wide":  # log-uniform over 1e-3..1e2
        return torch.pow(10.0, -3 + 5 * u)
    if kind == "negative":
        return -(0.25 + u)
    if kind == "mixed_sign":
        return torch.where(u < 0.5, -(0.2 + u), 0.2 + u)
    if kind == "zeros":
        return torch.zeros(count)
    if kind == "some_zero":
        values = 0.5 + u
        values[0] = 0.0
        return values
    if kind == "nan":
        values = 0.5 + u
        values[-1] = math.nan
        return values
    if kind == "inf":
        values = 0.5 + u
        values[-1] = math.inf
        return values
    return 0.5 + u  # "moderate"


SCALE_VALUES = ("moderate", "tiny", "huge", "wide", "negative", "mixed_sign", "zeros", "some_zero")
NON_FINITE_SCALES = ("nan", "inf")  # the fold must decline these


def scalar_mul_conv(case: ScalarMulCase) -> nn.Module:
    kind = CONV_KINDS[case.conv]
    dims = kind["dims"]
    groups = case.in_channels if kind.get("depthwise") else kind.get("groups", 1)
    out_channels = case.in_channels if kind.get("depthwise") else case.out_channels
    dilation, stride = kind.get("dilation", 1), kind.get("stride", 1)
    if kind.get("transposed"):
        cls = nn.ConvTranspose1d if dims == 1 else nn.ConvTranspose2d
        return cls(case.in_channels, out_channels, 3, stride=stride, groups=groups, bias=case.bias)
    cls = nn.Conv1d if dims == 1 else nn.Conv2d
    return cls(
        case.in_channels,
        out_channels,
        3,
        stride=stride,
        padding=same_padding(3, dilation),
        dilation=dilation,
        groups=groups,
        bias=case.bias,
    )


class ConvScale(nn.Module):
    """conv(x) * s, with the case's scale shape, sharing and carried state."""

    def __init__(self, case: ScalarMulCase, generator: torch.Generator):
        super().__init__()
        self.case = case
        self.conv = scalar_mul_conv(case)
        channels, dims = self.conv.out_channels, CONV_KINDS[case.conv]["dims"]
        count = 1 if case.scale_kind == "scalar" else channels
        values = _scale_values(case.scale_values, count, generator)
        if case.scale_kind == "scalar":
            self.scale = float(values[0])
        elif case.scale_kind == "per_channel":
            self.register_buffer("scale", values.reshape(1, channels, *([1] * dims)))
        elif case.scale_kind == "spatial":
            spatial = _scale_values(case.scale_values, case.size + 4, generator)  # >= output
            self.register_buffer("scale", spatial.reshape(1, 1, *([1] * (dims - 1)), -1))
        if case.share:
            other = _scale_values("moderate", channels, generator)
            self.register_buffer("other_scale", other.reshape(1, channels, *([1] * dims)))
        if case.state == "buffer":
            self.register_buffer("state", torch.zeros(1, case.in_channels, *[case.size] * dims))

    def _scaled(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.case.scale_kind == "activation":
            scale = torch.sigmoid(x.mean()) + 0.5
        elif self.case.scale_kind == "spatial":
            scale = self.scale[..., : y.shape[-1]]
        else:
            scale = self.scale
        return scale * y if self.case.scale_first else y * scale

    def forward(self, x: torch.Tensor, *state: torch.Tensor):
        case = self.case
        if case.state == "buffer":
            x = x + self.state
        elif case.state == "marked_output":
            x = x + state[0]
        y = self._scaled(self.conv(x), x)
        if case.share:
            y = y + self._shared_branch(x)
        if case.state == "buffer":
            self.state.copy_(torch.tanh(self._state_view(y)))
            return y
        if case.state == "marked_output":
            return y, torch.tanh(self._state_view(y))
        return y

    def _shared_branch(self, x: torch.Tensor) -> torch.Tensor:
        """The same weight, read by a second conv with another scale."""
        conv = self.conv
        if self.case.shared_input == "mirrored":
            x = x.flip(-1)
        if isinstance(conv, nn.ConvTranspose1d | nn.ConvTranspose2d):
            fn = F.conv_transpose1d if isinstance(conv, nn.ConvTranspose1d) else F.conv_transpose2d
            y = fn(x, conv.weight, None, conv.stride, conv.padding, 0, conv.groups, conv.dilation)
        else:
            fn = F.conv1d if isinstance(conv, nn.Conv1d) else F.conv2d
            y = fn(x, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)
        return y * self.other_scale

    def _state_view(self, y: torch.Tensor) -> torch.Tensor:
        """y cropped (or padded) and channel-matched to the state's shape."""
        target = [1, self.case.in_channels, *[self.case.size] * (y.dim() - 2)]
        y = y[:, : target[1]]
        if y.shape[1] < target[1]:
            y = torch.cat([y, y.new_zeros(1, target[1] - y.shape[1], *y.shape[2:])], dim=1)
        for axis in range(2, y.dim()):
            y = y.narrow(axis, 0, min(y.shape[axis], target[axis]))
            if y.shape[axis] < target[axis]:
                pad = [0, 0] * (y.dim() - 1 - axis) + [0, target[axis] - y.shape[axis]]
                y = F.pad(y, pad)
        return y


def build_scalar_mul(case: ScalarMulCase) -> Built:
    torch.manual_seed(case.seed)
    generator = seeded_generator(case.seed + 1)
    module = ConvScale(case, generator).eval()
    dims = CONV_KINDS[case.conv]["dims"]
    shape = (1, case.in_channels, *[case.size] * dims)
    steps = 3 if case.state != "none" else 1
    samples = [(randn(generator, *shape, scale=2.0),) for _ in range(steps + 3)]
    if case.state == "marked_output":
        samples = [(x, torch.zeros(shape)) for (x,) in samples]
    calls = [Call("forward", s) for s in samples[:steps]]
    feedback = (1, 1) if case.state == "marked_output" else None
    return Built(module, {"forward": samples[0]}, calls, samples[steps:], feedback)
