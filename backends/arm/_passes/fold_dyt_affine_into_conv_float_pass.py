# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Fold DyT's gamma/beta into the following conv in fp32, before calibration.

Given (gamma, beta constant per channel c; L at most one permute; conv groups g,
weight W[o, i, kh, kw] reading channel c(o, i)):

    u = gamma * tanh(alpha * x) + beta
    y = conv(L(u), W, b)

Result, unpadded conv:

    y = conv(L(tanh(alpha * x)), W * gamma[c(o, i)], b + sum_{i,kh,kw} W[o, i, kh, kw] * beta[c(o, i)])

Result, padded conv (a zero-padded border sees no beta, so beta stays before it):

    y = conv(L(tanh(alpha * x) + beta / gamma), W * gamma[c(o, i)], b)

Both are exact in real arithmetic. The quantizer then calibrates the folded
graph: the MUL (and, unpadded, the ADD) with their int8 requantizations are
gone, and the conv reads the tanh's own well-conditioned [-1, 1] range.

Declines where folding would hurt int8 quantization: per-output-channel weight
quantization gives all input channels of one output channel one scale, so a
gamma spread (largest |gamma| / smallest nonzero |gamma| among the channels an
output channel reads) above MAX_GAMMA_SPREAD costs the small-gamma channels
more than log2(MAX_GAMMA_SPREAD) bits of weight precision; and, padded, a
|beta / gamma| above MAX_SHIFT widens the tanh's range by more than that factor.
Runs in the Arm annotation pipeline (on the ATen graph, constants as get_attr).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from executorch.backends.arm._passes.arm_pass import ArmPass
from executorch.exir.pass_base import ExportPass, PassResult
from torch.fx import GraphModule, Node

from etfold.backends.arm._passes.channel_vectors import channel_vector, conv_input_channels
from etfold.backends.arm._passes.constants import (
    constant_tensor,
    create_constant,
    delete_constant_if_unused,
)
from etfold.backends.arm._passes.conv_arguments import (
    ConvArguments,
    conv_arguments,
    set_conv_argument,
)
from etfold.backends.arm._passes.fake_values import ensure_fake_values
from etfold.backends.arm._passes.layout_axes import Layout, axis_before_layout_op, layout_kind
from etfold.decisions import Declined, record_declined
from etfold.exir.passes.node_rewrite_driver import rewrite_each_match
from etfold.exir.passes.node_shapes import node_value, rank_of

FOLD = "arm.dyt_affine_into_conv_float"

MAX_GAMMA_SPREAD = 8.0
MAX_SHIFT = 4.0

_aten = torch.ops.aten
_MULS = (_aten.mul.Tensor,)
_ADDS = (_aten.add.Tensor,)
_TANH = (_aten.tanh.default,)
_SLICES = (_aten.slice.Tensor, _aten.slice_copy.Tensor)
# what may sit between the affine and the layer; only permutes and views fold
_WALKED = (Layout.PERMUTE, Layout.VIEW, Layout.TRANSPOSE)


@dataclass(frozen=True)
class _Conv:
    node: Node
    weight_node: Node
    bias_node: Node | None
    weight: torch.Tensor
    bias: torch.Tensor | None
    padded: bool
    groups: int


@dataclass(frozen=True)
class _Site:
    conv: _Conv
    layout: tuple[Node, ...]  # conv first
    channel_axis: int | None  # axis of the affine's tensors that the layer reads as channels
    output: Node  # the affine's last node (what the layout / conv reads)
    tanh: Node
    mul: Node | None
    add: Node | None
    gamma_arg: object
    beta_arg: object


def _constant_weight_and_bias(weight_node: Node, bias_arg, weight_dims: int):
    """(bias node or None, weight, bias or None) when the weight, and any bias, are constants."""
    weight = constant_tensor(weight_node)
    bias_node = bias_arg if isinstance(bias_arg, Node) else None
    bias = constant_tensor(bias_node) if bias_node is not None else None
    if weight is None or weight.dim() != weight_dims or (bias_node is not None and bias is None):
        return None
    return bias_node, weight, bias


def _conv(node: Node) -> _Conv | None:
    """A plain 2-D conv (int padding) or a linear (a conv with no spatial dims: weight
    [out, in], no padding, one group) with constant weight and bias."""
    arguments = _plain_layer(node)
    if arguments is None or not isinstance(arguments.weight, Node):
        return None
    if not all(isinstance(p, int) for p in arguments.padding):
        return None
    dims = 2 if arguments.linear else 4
    constants = _constant_weight_and_bias(arguments.weight, arguments.bias, weight_dims=dims)
    if constants is None:
        return None
    return _Conv(node, arguments.weight, *constants, arguments.padded, arguments.groups)


def _plain_layer(node: Node) -> ConvArguments | None:
    """The arguments of a linear or a 2-D conv that is not transposed."""
    arguments = conv_arguments(node)
    if isinstance(arguments, Declined) or arguments.transposed:
        return None
    return arguments if arguments.linear or arguments.spatial_dims == 2 else None


def _constant_operand(node: Node) -> tuple[int, object] | None:
    """(index of the non-constant operand, the constant) of a binary op, if one is constant."""
    if len(node.args) < 2:
        return None
    for index in (0, 1):
        other = node.args[1 - index]
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return index, other
        if isinstance(other, Node) and other.op == "get_attr":
            return index, other
    return None


def _site(node: Node) -> _Site | None:
    conv = _conv(node)
    if conv is None:
        return None
    layout: list[Node] = []
    current = node.args[0]
    rank = rank_of(current)
    if rank is None:
        return None
    axis: int | None = rank - 1 if conv.weight.dim() == 2 else 1
    while layout_kind(current) in _WALKED or (
        isinstance(current, Node) and current.op == "call_function" and current.target in _SLICES
    ):
        axis = axis_before_layout_op(current, axis)
        layout.append(current)
        current = current.args[0]
    if not isinstance(current, Node):
        return None
    output = current
    add = mul = None
    beta_arg = gamma_arg = None
    if (
        current.op == "call_function"
        and current.target in _ADDS
        and current.kwargs.get("alpha", 1) == 1
    ):
        found = _constant_operand(current)
        if found is None:
            return None
        add, beta_arg = current, found[1]
        current = current.args[found[0]]
    if isinstance(current, Node) and current.op == "call_function" and current.target in _MULS:
        found = _constant_operand(current)
        if found is None:
            return None
        mul, gamma_arg = current, found[1]
        current = current.args[found[0]]
    if add is None and mul is None:
        return None
    if (
        not isinstance(current, Node)
        or current.op != "call_function"
        or current.target not in _TANH
    ):
        return None
    return _Site(conv, tuple(layout), axis, output, current, mul, add, gamma_arg, beta_arg)


# --- predicates -----------------------------------------------------------------


def layout_is_one_permute(site: _Site) -> Declined | None:
    permutes = sum(layout_kind(n) is Layout.PERMUTE for n in site.layout)
    views = sum(layout_kind(n) is Layout.VIEW for n in site.layout)
    if permutes > 1 or len(site.layout) != permutes + views or site.channel_axis is None:
        return Declined(
            "ambiguous layout provenance: only one permute, and views keeping the channel "
            "axis whole, may sit between DyT and the conv or linear"
        )
    return None


def affine_feeds_only_the_conv(site: _Site) -> Declined | None:
    chain = [n for n in (site.mul, site.add) if n is not None]
    readers = [*chain[1:], *reversed(site.layout), site.conv.node]
    for node, reader in zip([*chain, *reversed(site.layout)], readers, strict=True):
        if set(node.users) != {reader}:
            return Declined("the DyT output (or its permute) has users other than the conv")
    return None


def _vector(arg: object, channels: int, axis: int, rank: int) -> torch.Tensor | None:
    if arg is None:
        return None
    value = torch.tensor(float(arg)) if isinstance(arg, (int, float)) else constant_tensor(arg)
    vector = None if value is None else channel_vector(value, rank, axis, channels)
    return None if vector is None else vector.to(torch.float64).clone()


def constants_are_channel_vectors(
    site: _Site, channels: int
) -> tuple[torch.Tensor, torch.Tensor] | Declined:
    rank = rank_of(site.output)
    gamma = (
        _vector(site.gamma_arg, channels, site.channel_axis, rank)
        if site.mul
        else torch.ones(channels, dtype=torch.float64)
    )
    beta = (
        _vector(site.beta_arg, channels, site.channel_axis, rank)
        if site.add
        else torch.zeros(channels, dtype=torch.float64)
    )
    if gamma is None or beta is None:
        return Declined("gamma/beta are not constants varying along the conv's channel axis only")
    if not (torch.isfinite(gamma).all() and torch.isfinite(beta).all()):
        return Declined("gamma/beta hold NaN or Inf")
    return gamma, beta


def _read_channels(conv: _Conv) -> torch.Tensor:
    out_channels, per_group = conv.weight.shape[:2]
    return conv_input_channels(out_channels, per_group, conv.groups)


def channels_line_up(site: _Site, channels: int) -> Declined | None:
    out_channels, per_group = site.conv.weight.shape[:2]
    if per_group * site.conv.groups != channels or out_channels % site.conv.groups:
        return Declined("the conv's input channels do not line up with DyT's channels")
    return None


def gamma_spread_within_bound(site: _Site, gamma: torch.Tensor) -> Declined | None:
    read = gamma.abs()[_read_channels(site.conv)]  # [O, I/g]
    weight = site.conv.weight
    used = (weight.abs().reshape(*weight.shape[:2], -1).sum(-1) > 0) & (read > 0)
    if not bool(used.any()):
        return None
    largest = torch.where(used, read, torch.zeros_like(read)).amax(dim=1)
    smallest = torch.where(used, read, torch.full_like(read, math.inf)).amin(dim=1)
    spread = float((largest / smallest)[used.any(dim=1)].max().detach())
    if spread > MAX_GAMMA_SPREAD:
        return Declined(
            f"gamma spread {spread:.3g} across the input channels of one output channel exceeds "
            f"{MAX_GAMMA_SPREAD:g}: per-channel int8 weights would lose precision"
        )
    return None


def padded_beta_can_stay(
    site: _Site, gamma: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor | Declined | None:
    """None when unpadded; else beta / gamma (0 where both are 0), or why it cannot stay."""
    if not site.conv.padded or not bool((beta != 0).any()):
        return None
    if bool(((gamma == 0) & (beta != 0)).any()):
        return Declined(
            "padded conv: beta cannot stay before the conv on a channel whose gamma is 0"
        )
    shifted = torch.where(gamma == 0, torch.zeros_like(beta), beta / gamma)
    if float(shifted.abs().max()) > MAX_SHIFT:
        return Declined(
            f"padded conv: |beta / gamma| up to {float(shifted.abs().max()):.3g} exceeds {MAX_SHIFT:g}"
        )
    return shifted


@dataclass(frozen=True)
class FloatAffineMatch:
    site: _Site
    weight: torch.Tensor
    bias: torch.Tensor | None  # None: the bias is unchanged
    shifted_beta: torch.Tensor | None  # padded: beta / gamma, added to the tanh


def match_float_affine(node: Node) -> FloatAffineMatch | Declined | None:
    site = _site(node)
    if site is None:
        return None
    for predicate in (layout_is_one_permute, affine_feeds_only_the_conv):
        if (declined := predicate(site)) is not None:
            return declined
    value = node_value(site.output)
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return Declined("the DyT output is not a tensor of known shape")
    channels = int(value.shape[site.channel_axis])
    if (declined := channels_line_up(site, channels)) is not None:
        return declined
    vectors = constants_are_channel_vectors(site, channels)
    if isinstance(vectors, Declined):
        return vectors
    gamma, beta = vectors
    if (declined := gamma_spread_within_bound(site, gamma)) is not None:
        return declined
    shifted = padded_beta_can_stay(site, gamma, beta)
    if isinstance(shifted, Declined):
        return shifted
    conv = site.conv
    read = _read_channels(conv)
    weight64 = conv.weight.to(torch.float64)
    spatial = [1] * (weight64.dim() - 2)
    weight = (weight64 * gamma[read].reshape(*read.shape, *spatial)).to(conv.weight.dtype)
    bias = None
    if shifted is None and bool((beta != 0).any()):
        base = (
            conv.bias.to(torch.float64)
            if conv.bias is not None
            else torch.zeros(weight.shape[0], dtype=torch.float64)
        )
        per_input = weight64 * beta[read].reshape(*read.shape, *spatial)
        bias = (base + per_input.reshape(per_input.shape[0], -1).sum(-1)).to(conv.weight.dtype)
    return FloatAffineMatch(site, weight, bias, shifted)


def _shape_like(vector: torch.Tensor, axis: int, dtype: torch.dtype, rank: int) -> torch.Tensor:
    shape = [1] * rank
    shape[axis] = vector.numel()
    return vector.to(dtype).reshape(shape[axis:])


def rewrite_float_affine(graph_module: GraphModule, match: FloatAffineMatch) -> None:
    site = match.site
    conv = site.conv
    graph = graph_module.graph

    def fresh(like: Node, stem: str, data: torch.Tensor) -> Node:
        return create_constant(
            graph_module, None, like=like, stem=stem, data=data, reader=conv.node.name
        )

    weight_node = fresh(
        conv.weight_node, f"{conv.weight_node.target}_times_dyt_gamma", match.weight
    )
    set_conv_argument(conv.node, "weight", weight_node)
    if match.bias is not None:
        like = conv.bias_node if conv.bias_node is not None else conv.weight_node
        stem = f"{like.target}_plus_dyt_beta"
        set_conv_argument(conv.node, "bias", fresh(like, stem, match.bias))

    new_input: Node = site.tanh
    if match.shifted_beta is not None:
        beta_like = site.beta_arg if isinstance(site.beta_arg, Node) else conv.weight_node
        beta_value = node_value(site.output)
        shifted = fresh(
            beta_like,
            f"{site.tanh.name}_dyt_beta_over_gamma",
            _shape_like(match.shifted_beta, site.channel_axis, beta_value.dtype, beta_value.dim()),
        )
        with graph.inserting_after(site.tanh):
            new_input = graph.call_function(_aten.add.Tensor, (site.tanh, shifted))
        new_input.meta = dict(site.add.meta)
    reader = site.layout[-1] if site.layout else conv.node
    reader.replace_input_with(site.output, new_input)
    for node in (site.add, site.mul):
        if node is not None and not node.users:
            graph.erase_node(node)
    for constant in (site.beta_arg, site.gamma_arg, conv.weight_node, conv.bias_node):
        if isinstance(constant, Node) and constant.op == "get_attr":
            delete_constant_if_unused(graph_module, None, constant)


class FoldDyTAffineIntoConvFloatPass(ArmPass):
    """`conv(L(gamma * tanh(alpha x) + beta))` -> `conv'(L(tanh(alpha x)))`; see the module docstring.

    Runs standalone too: nodes without meta["val"] get one by fake propagation
    first; if that is impossible the pass declines with the reason.
    """

    _passes_required_after: set[type[ExportPass]] = set()

    def __init__(self, tfa_pass: bool = True) -> None:
        super().__init__(tfa_pass=tfa_pass)

    def call(self, graph_module: GraphModule) -> PassResult:
        layers = [n for n in graph_module.graph.nodes if _plain_layer(n) is not None]
        if layers and (declined := ensure_fake_values(graph_module)) is not None:
            record_declined(FOLD, layers[0].name, declined.reason)
            return PassResult(graph_module, False)

        def rewrite(match: FloatAffineMatch) -> str:
            rewrite_float_affine(graph_module, match)
            if match.shifted_beta is not None:
                return "gamma into the conv weight, beta kept as beta/gamma before the padded conv"
            return "gamma into the conv weight, beta into the bias"

        allowed = [node for node in layers if self.allowed_to_transform(node.meta)]
        modified = rewrite_each_match(allowed, match_float_affine, rewrite, FOLD)
        if modified:
            graph_module.graph.lint()
            graph_module.recompile()
        return PassResult(graph_module, modified)
