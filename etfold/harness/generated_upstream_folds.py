# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.


"""Generated cases for upstream's folds around etfold's: conv/linear layers followed by
batch norm, activation and scale chains, with shared weights, biases, batch norms and
scales, constants equal by value, and intermediates read twice, for XNNPACK fp32/fp16,
TOSA FP and TOSA INT.

Each branch is `layer -> chain`; the branches after the first share with the first
what the case's `share` names. `untied(module)` is the same model with every shared
parameter, buffer and submodule copied apart: the INT oracle's reference."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from etfold.harness.generated_cases import DTYPES, Built, Call, randn, seeded_generator


@dataclass(frozen=True)
class UpstreamFoldsCase:
    seed: int
    layer: str  # a key of LAYER_KINDS
    in_channels: int
    out_channels: int  # depthwise: the input's channels
    size: int  # spatial extent; a 2-D input is size x (size + 1)
    batch: int
    bias: bool
    chain: tuple[str, ...]  # keys of CHAIN_OPS, applied in order after the layer
    share: str = "none"  # a key of SHARE_MODES
    extra_reader: str = "none"  # a key of EXTRA_READERS
    mirrored: bool = False  # the branches after the first read x flipped along its last axis
    combine: str = "tuple"  # "tuple": every branch an output; "sum": their sum
    backend: str = "xnnpack_fp32"  # a key of BACKENDS
    stride: int = 1
    bn_shared: str = "module"  # share="bn": "module" (one BatchNorm) or "gamma" (its weight only)

    family = "upstream_folds"


# layer kind -> spatial dims (0: linear on a 2-D input) and whether it is transposed
LAYER_KINDS = {
    "conv2d": dict(dims=2),
    "depthwise": dict(dims=2, depthwise=True),
    "transposed2d": dict(dims=2, transposed=True),
    "conv1d": dict(dims=1),
    "transposed1d": dict(dims=1, transposed=True),
    "linear": dict(dims=0),
}

CHAIN_OPS = ("bn", "relu", "relu6", "hardtanh", "clamp", "scale_scalar", "scale_channel")

SHARE_MODES = {
    "none": 1,  # branches
    "weight": 2,  # one weight Parameter
    "bias": 2,  # one bias Parameter
    "three": 3,  # three layers, one weight
    "weight_and_bias": 2,
    "bn": 2,  # two layers, one batch-norm module
    "scale": 2,  # one per-channel scale buffer
    "equal_weight": 2,  # weights equal by value, distinct tensors
    "equal_bias": 2,
    "equal_bn": 2,  # batch norms with equal statistics, distinct tensors
    "equal_scale": 2,
}

EXTRA_READERS = (
    "none",
    "layer_op",  # another op also reads the layer's output
    "layer_output",  # the layer's output is also a program output
    "middle_op",  # another op also reads the first chain op's output
)

BACKENDS = ("xnnpack_fp32", "xnnpack_fp16", "tosa_fp", "tosa_int")


def _layer(case: UpstreamFoldsCase) -> nn.Module:
    kind = LAYER_KINDS[case.layer]
    if kind["dims"] == 0:
        return nn.Linear(case.in_channels, case.out_channels, bias=case.bias)
    depthwise = kind.get("depthwise", False)
    out_channels = case.in_channels if depthwise else case.out_channels
    groups = case.in_channels if depthwise else 1
    if kind.get("transposed"):
        cls = nn.ConvTranspose1d if kind["dims"] == 1 else nn.ConvTranspose2d
        return cls(case.in_channels, out_channels, 3, stride=case.stride, bias=case.bias)
    cls = nn.Conv1d if kind["dims"] == 1 else nn.Conv2d
    return cls(
        case.in_channels, out_channels, 3, stride=case.stride, padding=1, groups=groups,
        bias=case.bias,
    )  # fmt: skip


def _signed(values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    signs = torch.where(torch.rand(values.shape, generator=generator) < 0.2, -1.0, 1.0)
    return values * signs


def _batch_norm(channels: int, dims: int, generator: torch.Generator) -> nn.Module:
    bn = nn.BatchNorm1d(channels) if dims <= 1 else nn.BatchNorm2d(channels)
    with torch.no_grad():
        bn.running_mean.copy_(2 * torch.rand(channels, generator=generator) - 1)
        bn.running_var.copy_(0.3 + 2 * torch.rand(channels, generator=generator))
        bn.weight.copy_(_signed(0.5 + 1.5 * torch.rand(channels, generator=generator), generator))
        bn.bias.copy_(2 * torch.rand(channels, generator=generator) - 1)
    return bn


class Branch(nn.Module):
    """layer(x) -> chain, and the extra reader of the case."""

    def __init__(self, case: UpstreamFoldsCase, generator: torch.Generator):
        super().__init__()
        self.case = case
        self.layer = _layer(case)
        channels = self.layer.out_features if case.layer == "linear" else self.layer.out_channels
        dims = LAYER_KINDS[case.layer]["dims"]
        if "bn" in case.chain:
            self.bn = _batch_norm(channels, dims, generator)
        if "scale_channel" in case.chain:
            values = _signed(0.5 + torch.rand(channels, generator=generator), generator)
            self.register_buffer("scale", values.reshape(channels, *([1] * dims)))
        self.scalar = float(_signed(0.25 + torch.rand(1, generator=generator), generator))

    def _chain_op(self, op: str, y: torch.Tensor) -> torch.Tensor:
        if op == "bn":
            return self.bn(y)
        if op == "relu":
            return torch.relu(y)
        if op == "relu6":
            return F.relu6(y)
        if op == "hardtanh":
            return F.hardtanh(y, -1.5, 1.0)
        if op == "clamp":
            return torch.clamp(y, min=-0.75, max=2.0)
        if op == "scale_scalar":
            return y * self.scalar
        return y * self.scale

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        z = self.layer(x)
        y, middle = z, None
        for index, op in enumerate(self.case.chain):
            y = self._chain_op(op, y)
            if index == 0:
                middle = y
        reader = self.case.extra_reader
        if reader == "layer_op":
            return [y + torch.tanh(z)]
        if reader == "layer_output":
            return [y, z]
        if reader == "middle_op" and len(self.case.chain) > 1:
            return [y - 0.5 * torch.sigmoid(middle)]
        return [y]


def _share(branches: list[Branch], case: UpstreamFoldsCase) -> None:
    """The branches after the first read the first one's constants as `share` says."""
    first, share = branches[0], case.share
    if share == "bn" and case.bn_shared == "gamma":
        share = "bn_gamma"
    for other in branches[1:]:
        if share in ("weight", "three", "weight_and_bias"):
            other.layer.weight = first.layer.weight
        if share in ("bias", "weight_and_bias"):
            other.layer.bias = first.layer.bias
        if share == "bn":
            other.bn = first.bn
        if share == "bn_gamma":
            other.bn.weight = first.bn.weight
        if share == "scale":
            other.scale = first.scale
        if share == "equal_weight":
            other.layer.weight = nn.Parameter(first.layer.weight.detach().clone())
        if share == "equal_bias":
            other.layer.bias = nn.Parameter(first.layer.bias.detach().clone())
        if share == "equal_bn":
            other.bn.load_state_dict(first.bn.state_dict())
        if share == "equal_scale":
            other.scale = first.scale.clone()


class UpstreamFoldsModel(nn.Module):
    def __init__(self, case: UpstreamFoldsCase, generator: torch.Generator):
        super().__init__()
        self.case = case
        branches = [Branch(case, generator) for _ in range(SHARE_MODES[case.share])]
        _share(branches, case)
        self.branches = nn.ModuleList(branches)

    def forward(self, x: torch.Tensor):
        outputs = []
        for index, branch in enumerate(self.branches):
            outputs += branch(x.flip(-1) if self.case.mirrored and index else x)
        if self.case.combine == "sum":
            return sum(outputs[1:], outputs[0])
        return tuple(outputs)


def shares_state(module: nn.Module) -> bool:
    """Some submodule, parameter or buffer is reachable under two names."""
    for named in (module.named_modules, module.named_parameters, module.named_buffers):
        if len(list(named(remove_duplicate=False))) != len(list(named())):
            return True
    return False


def untied(module: nn.Module) -> nn.Module:
    """A deep copy in which no submodule, parameter or buffer is reachable twice."""
    copied = copy.deepcopy(module)
    seen_modules, seen_tensors = set(), set()
    for parent in list(copied.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None and id(child) in seen_modules:
                child = copy.deepcopy(child)
                parent._modules[name] = child
            if child is not None:
                seen_modules.add(id(child))
    for owner in copied.modules():
        for store in (owner._parameters, owner._buffers):
            for name, tensor in list(store.items()):
                if tensor is None:
                    continue
                if id(tensor) in seen_tensors:
                    store[name] = _fresh(tensor)
                seen_tensors.add(id(store[name]))
    return copied


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(tensor.detach().clone(), tensor.requires_grad)
    return tensor.detach().clone()


def input_shape(case: UpstreamFoldsCase) -> tuple[int, ...]:
    dims = LAYER_KINDS[case.layer]["dims"]
    spatial = [(case.size,), (case.size, case.size + 1)][dims - 1] if dims else ()
    return (case.batch, case.in_channels, *spatial)


def dtype_of(case: UpstreamFoldsCase) -> torch.dtype:
    return DTYPES["float16" if case.backend == "xnnpack_fp16" else "float32"]


def build_upstream_folds(case: UpstreamFoldsCase) -> Built:
    torch.manual_seed(case.seed)
    generator = seeded_generator(case.seed + 1)
    dtype = dtype_of(case)
    module = UpstreamFoldsModel(case, generator).eval().to(dtype)
    shape = input_shape(case)
    samples = [(randn(generator, *shape, scale=1.5).to(dtype),) for _ in range(2 + 6)]
    calls = [Call("forward", s) for s in samples[:2]]
    return Built(module, {"forward": samples[0]}, calls, samples[2:])
