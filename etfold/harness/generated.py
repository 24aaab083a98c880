# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Model builders for generated differential cases, one case spec per fold family.

A case is a frozen dataclass of plain values (printable, so a failing case is
its own repro); `build(case)` turns it into a seeded module, its inputs and a
call schedule. The hypothesis strategies that draw cases are
`etfold.harness.fuzz_strategies`;
the runner that lowers them with stock ExecuTorch and etfold is
`etfold.harness.differential`.

Families:
- `WeightFoldCase`: GEMM stacks (conv1d/2d, transposed, linear) whose weights
  are computed from parameters (parametrizations, user expressions, shared
  parameters, buffers), for the XNNPACK pre-decomposition weight fold.
- `ConvertsCase`: chains of fp32/bf16/fp16 regions joined by casts, for the
  XNNPACK dtype-convert delegation.
- `ScalarMulCase`: conv * scale variants, for the Arm scalar-mul fold.
- `DyTCase`: DyT then a conv, for the Arm DyT folds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Call:
    """One call of a built case: `getattr(module, method)(*inputs)`."""

    method: str
    inputs: tuple[torch.Tensor, ...]


@dataclass
class Built:
    """A case made concrete: the module, the methods to export and the calls to compare."""

    module: nn.Module
    methods: dict[str, tuple[torch.Tensor, ...]]  # method -> example inputs for export
    calls: list[Call]  # in order, on one program instance (stateful rollouts carry over)
    calibration: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    # (output, input): each call after the first takes that input from the previous call's output
    feedback: tuple[int, int] | None = None


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(generator: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=generator)


def _same_padding(kernel: int, dilation: int) -> int:
    """The smallest padding that keeps a stride-1 conv's output at least as long as its input
    minus one, so no generated size collapses below 1."""
    return math.ceil(dilation * (kernel - 1) / 2)


# ---------------------------------------------------------------- XNNPACK weight fold


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
    padding = _same_padding(spec.kernel, spec.dilation)
    if spec.kind == "conv":
        cls = nn.Conv1d if dims == 1 else nn.Conv2d
        return cls(
            in_channels,
            spec.out_channels,
            spec.kernel,
            stride=spec.stride,
            padding=padding,
            dilation=spec.dilation,
            groups=spec.groups,
            bias=spec.bias,
        )
    cls = nn.ConvTranspose1d if dims == 1 else nn.ConvTranspose2d
    return cls(
        in_channels,
        spec.out_channels,
        spec.kernel,
        stride=spec.stride,
        dilation=spec.dilation,
        groups=spec.groups,
        bias=spec.bias,
    )


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
    generator = _generator(case.seed + 1)
    shape = (case.batch, case.in_channels, *case.size)

    def sample() -> tuple[torch.Tensor]:
        return (_randn(generator, *shape).to(DTYPES[case.dtype]),)

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


# ---------------------------------------------------------------- XNNPACK dtype converts


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
    generator = _generator(case.seed + 1)
    shape = (1, case.channels, *case.size)
    samples = [(_randn(generator, *shape).to(DTYPES[case.model_dtype]),) for _ in range(2)]
    return Built(module, {"forward": samples[0]}, [Call("forward", s) for s in samples])


# ---------------------------------------------------------------- Arm scalar-mul


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
        padding=_same_padding(3, dilation),
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
    generator = _generator(case.seed + 1)
    module = ConvScale(case, generator).eval()
    dims = CONV_KINDS[case.conv]["dims"]
    shape = (1, case.in_channels, *[case.size] * dims)
    steps = 3 if case.state != "none" else 1
    samples = [(_randn(generator, *shape, scale=2.0),) for _ in range(steps + 3)]
    if case.state == "marked_output":
        samples = [(x, torch.zeros(shape)) for (x,) in samples]
    calls = [Call("forward", s) for s in samples[:steps]]
    feedback = (1, 1) if case.state == "marked_output" else None
    return Built(module, {"forward": samples[0]}, calls, samples[steps:], feedback)


# ---------------------------------------------------------------- Arm DyT


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
    generator = _generator(case.seed + 1)
    module = DyTThenConv(case, generator).eval()
    shape = (1, case.channels, *case.size)
    samples = [(_randn(generator, *shape, scale=2.0),) for _ in range(4)]
    return Built(module, {"forward": samples[0]}, [Call("forward", samples[0])], samples[1:])


BUILDERS = {
    WeightFoldCase: build_weight_fold,
    ConvertsCase: build_converts,
    ScalarMulCase: build_scalar_mul,
    DyTCase: build_dyt,
}


def build(case) -> Built:
    return BUILDERS[type(case)](case)


def describe(case) -> str:
    """The case as a constructor call: paste it to reproduce."""
    return repr(case)


def replace(case, **changes):
    return dataclasses.replace(case, **changes)
