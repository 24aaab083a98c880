# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.


"""Generated XNNPACK weight-fold cases: GEMM stacks (conv1d/2d, transposed, linear) whose
weights are computed from parameters (parametrizations, user expressions, shared
parameters, buffers), for the pre-decomposition weight fold."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from etfold.harness.generated_cases import (
    DTYPES,
    Built,
    Call,
    randn,
    same_padding,
    seeded_generator,
)


@dataclass(frozen=True)
class GemmLayer:
    kind: str  # "conv", "conv_transpose", "linear"
    out_channels: int
    kernel: int = 1
    stride: int = 1
    dilation: int = 1
    groups: int = 1
    bias: bool = True
    weight: str = "plain"  # a key of WEIGHT_EXPRESSIONS
    activation: str = "none"  # "none", "relu", "tanh"


@dataclass(frozen=True)
class WeightFoldCase:
    seed: int
    dims: int  # spatial dims of the stack: 1 (conv1d) or 2 (conv2d)
    in_channels: int
    size: tuple[int, ...]  # spatial size of the input
    batch: int
    layers: tuple[GemmLayer, ...]
    share: str = "none"  # a key of SHARE_MODES
    buffer: str = "none"  # "none", "read", "written_by_other_method", "written_in_forward"
    second_method: bool = False  # a second method reading the same parameters
    dtype: str = "float32"

    family = "weight_fold"


class _Elementwise(nn.Module):
    def forward(self, w):
        return 0.75 * w + 0.1 * torch.tanh(w)


class _Reshape(nn.Module):
    def forward(self, w):
        return w.flatten().roll(1).reshape(w.shape)


class _MatMul(nn.Module):
    def __init__(self, rows: int):
        super().__init__()
        self.mix = nn.Parameter(torch.eye(rows) + 0.05 * torch.randn(rows, rows))

    def forward(self, w):
        return (self.mix.to(w.dtype) @ w.flatten(1)).reshape(w.shape)


class _Exp(nn.Module):
    def forward(self, w):
        return torch.exp(0.5 * w) - 1.0


class _Sum(nn.Module):
    def forward(self, w):
        return w + 0.1 * w.sum(dim=0, keepdim=True)


def _user(factory):
    def apply(layer: nn.Module) -> nn.Module:
        parametrize.register_parametrization(layer, "weight", factory(layer.weight))
        return layer

    return apply


def _orthogonal(orthogonal_map: str):
    def apply(layer: nn.Module) -> nn.Module:
        return nn.utils.parametrizations.orthogonal(layer, orthogonal_map=orthogonal_map)

    return apply


# How a layer's weight is computed from its parameters; every entry is a fold candidate.
WEIGHT_EXPRESSIONS = {
    "plain": lambda layer: layer,
    "weight_norm": lambda layer: nn.utils.parametrizations.weight_norm(layer),
    "spectral_norm": lambda layer: nn.utils.parametrizations.spectral_norm(layer),
    "orthogonal_matrix_exp": _orthogonal("matrix_exp"),
    "orthogonal_householder": _orthogonal("householder"),
    "user_elementwise": _user(lambda w: _Elementwise()),
    "user_reshape": _user(lambda w: _Reshape()),
    "user_matmul": _user(lambda w: _MatMul(w.shape[0])),
    "user_exp": _user(lambda w: _Exp()),
    "user_sum": _user(lambda w: _Sum()),
}

# How other parts of the model read the first layer's weight as well.
SHARE_MODES = (
    "none",
    "tied",  # a second branch convolves with the same parameter
    "derived",  # a second branch convolves with an expression of that parameter
    "operand",  # the weight also enters the activations elementwise
)

_ACTIVATIONS = {"none": lambda x: x, "relu": torch.relu, "tanh": torch.tanh}


def gemm_layer_module(spec: GemmLayer, dims: int, in_channels: int) -> nn.Module:
    if spec.kind == "linear":
        return nn.Linear(in_channels, spec.out_channels, bias=spec.bias)
    shared = dict(stride=spec.stride, dilation=spec.dilation, groups=spec.groups, bias=spec.bias)
    if spec.kind == "conv":
        cls = nn.Conv1d if dims == 1 else nn.Conv2d
        shared["padding"] = same_padding(spec.kernel, spec.dilation)
    else:
        cls = nn.ConvTranspose1d if dims == 1 else nn.ConvTranspose2d
    return cls(in_channels, spec.out_channels, spec.kernel, **shared)


def _gemm(layer: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`layer` applied with another weight (same hyper-parameters, no bias)."""
    if isinstance(layer, nn.Linear):
        return F.linear(x.movedim(1, -1), weight).movedim(-1, 1)
    if isinstance(layer, nn.ConvTranspose1d | nn.ConvTranspose2d):
        fn = F.conv_transpose1d if isinstance(layer, nn.ConvTranspose1d) else F.conv_transpose2d
        return fn(x, weight, None, layer.stride, layer.padding, 0, layer.groups, layer.dilation)
    fn = F.conv1d if isinstance(layer, nn.Conv1d) else F.conv2d
    return fn(x, weight, None, layer.stride, layer.padding, layer.dilation, layer.groups)


class GemmStack(nn.Module):
    """x -> layer_0 -> act -> layer_1 -> ..., with the case's sharing and buffer reads."""

    def __init__(self, case: WeightFoldCase):
        super().__init__()
        self.case = case
        layers, channels = [], case.in_channels
        for spec in case.layers:
            layer = gemm_layer_module(spec, case.dims, channels)
            layers.append(WEIGHT_EXPRESSIONS[spec.weight](layer))
            channels = spec.out_channels
        self.layers = nn.ModuleList(layers)
        first = case.layers[0]
        if case.buffer != "none":
            self.register_buffer("gain", torch.linspace(0.5, 1.5, first.out_channels))

    def _first(self, x: torch.Tensor) -> torch.Tensor:
        layer, case = self.layers[0], self.case
        y = layer(x.movedim(1, -1)).movedim(-1, 1) if isinstance(layer, nn.Linear) else layer(x)
        if case.buffer != "none":
            y = y * self.gain.reshape(-1, *([1] * (y.dim() - 2)))
        weight = layer.weight
        if case.share == "tied":
            y = y + _gemm(layer, x, weight)
        elif case.share == "derived":
            y = y + _gemm(layer, x, 0.5 * weight + 0.1 * torch.tanh(weight))
        elif case.share == "operand":
            y = y + weight.flatten(1).mean(1).reshape(-1, *([1] * (y.dim() - 2))).to(y.dtype)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._stack(x)

    def _stack(self, x: torch.Tensor) -> torch.Tensor:
        y = self._first(x)
        y = _ACTIVATIONS[self.case.layers[0].activation](y)
        for spec, layer in zip(self.case.layers[1:], self.layers[1:], strict=True):
            y = layer(y.movedim(1, -1)).movedim(-1, 1) if isinstance(layer, nn.Linear) else layer(y)
            y = _ACTIVATIONS[spec.activation](y)
        if self.case.buffer == "written_in_forward":
            self.gain.mul_(0.5).add_(0.25 * y.detach().mean())
        return y

    def half(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * self._stack(x)  # export swaps `forward` for the method it exports

    def update(self, x: torch.Tensor) -> torch.Tensor:
        self.gain.mul_(0.5).add_(0.25 * x.mean())
        return self.gain.clone()


def build_weight_fold(case: WeightFoldCase) -> Built:
    torch.manual_seed(case.seed)
    module = GemmStack(case).eval().to(DTYPES[case.dtype])
    generator = seeded_generator(case.seed + 1)
    shape = (case.batch, case.in_channels, *case.size)

    def sample() -> tuple[torch.Tensor]:
        return (randn(generator, *shape).to(DTYPES[case.dtype]),)

    x = sample()
    methods = {"forward": x}
    calls = [Call("forward", x), Call("forward", sample())]
    if case.second_method:
        methods["half"] = x
        calls.append(Call("half", sample()))
    if case.buffer == "written_by_other_method":
        methods["update"] = x
        calls = [Call("forward", x), Call("update", sample()), Call("forward", sample())]
        calls += [Call("update", sample()), Call("forward", sample())]
    return Built(module, methods, calls)
