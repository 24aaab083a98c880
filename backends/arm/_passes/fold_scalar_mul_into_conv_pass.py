# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Fold a constant scale after a convolution or linear layer into its weight and bias.

    L(layer(x, W, b)) * s     (s: a number, a scalar tensor constant, or a constant
    s * L(layer(x, W, b))      broadcast along the layer's output channels only)
      -> L(layer(x, W', b * s))

    W' = W * s[:, None, ...]                      linear, ordinary and grouped convs (out-channels lead W)
    W' = W.view(g, Cin/g, Cout/g, ...) * s.view(g, 1, Cout/g, 1, ...)
                                                   transposed convs (W is [Cin, Cout/g, ...])

L is what sits between a layer and its scale in real blocks (ConvNeXt's and
ViT's LayerScale): layout ops (permute, transpose, view/reshape) that keep the
channel axis whole, and ops that are the identity at inference (eval or p=0
dropout, clone, alias). Each moves the channel axis but never mixes channels,
so the scale commutes with it.

Exact in real arithmetic; in fp32 each folded weight is rounded once, as is each
product in the unfolded graph. Runs before calibration in the annotation
pipeline (so INT quantization calibrates the folded conv) and in the backend
pipeline (FP profile). W', b * s are new constants named from their source and a
digest of s; the sources are removed only once nothing reads them, and no
existing tensor is written (the annotation pipeline's tensors are the user's).
Before calibration it declines a conv whose product another conv also computes
(same input, same weight) where the two results meet downstream, unless they
meet in one add (or sub) with every channel's scales keeping its sign:
quantized, the twins round alike, and where their combination cancels, that
shared rounding cancels with it, which separately folded weights would lose.
Twins whose results never meet (separate outputs) fold; in float every fold is
exact up to fp32 rounding, twins or not. On an Ethos-U target it also declines
where Vela would schedule the folded graph worse (`npu_costs`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from executorch.backends.arm._passes.arm_pass import ArmPass
from executorch.exir.pass_base import ExportPass
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from etfold.backends.arm._passes.carried_state import carried_region
from etfold.backends.arm._passes.channel_vectors import channel_vector
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
from etfold.backends.arm._passes.layout_axes import axis_after_layout_op, is_layout
from etfold.backends.arm._passes.npu_costs import (
    multiply_keeps_the_transpose,
    per_channel_scale_into_transposed_conv,
)
from etfold.backends.arm._passes.op_families import is_inference_noop
from etfold.backends.arm._passes.twin_layers import meet, twin_layers
from etfold.decisions import Declined
from etfold.exir.passes.graph_walk import NAME_DIGEST_LENGTH, tensor_digest, underlying_op
from etfold.exir.passes.node_rewrite_driver import rewrite_each_match
from etfold.exir.passes.node_shapes import node_value, static_shape

FOLD = "arm.scalar_mul_into_conv"

DISALLOWED = "node is marked not to be transformed before annotation"
CARRIED_STATE = (
    "conv output reaches carried state (a written-back buffer or input, or a marked output)"
)
CARRIED_STATE_NOT_POWER_OF_TWO = (
    "conv output reaches carried state and the scale is not a positive scalar power of two"
    " (the only scale that folds there, and only inside power_of_two_scales_fold_into_carried_state())"
)
SEVERAL_USERS = "conv output has several users"

_power_of_two_into_carried_state: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "etfold_power_of_two_into_carried_state", default=False
)


@contextlib.contextmanager
def power_of_two_scales_fold_into_carried_state() -> Iterator[None]:
    """Opt-in for the block: a positive scalar power-of-two scale folds even where its
    multiply rounds carried state.

    Drift-free by construction: W * 2^k and b * 2^k are exact, every observed range
    scales by exactly 2^k, so the folded conv's RESCALE equals the unfolded conv's and
    the multiply's requantization was the identity on codes: the rollout is the
    unfolded one code for code (CONTRIBUTING.md, "Carried state").
    """
    token = _power_of_two_into_carried_state.set(True)
    try:
        yield
    finally:
        _power_of_two_into_carried_state.reset(token)


def is_positive_power_of_two(scale: torch.Tensor) -> bool:
    values = scale.detach().reshape(-1).unique()
    if values.numel() != 1:
        return False
    value = float(values[0])
    return value > 0 and math.isfinite(value) and math.frexp(value)[0] == 0.5


NO_SHAPE = "conv or mul has no shape metadata"
QUANTIZED = "conv is already quantized (fold runs before calibration for INT)"
WEIGHT_NOT_CONSTANT = "conv weight is not a constant"
BIAS_NOT_CONSTANT = "conv bias is not a constant"
SCALE_NOT_CONSTANT = "scale is not a constant"
SCALE_NOT_FINITE = "scale is not finite (NaN or Inf)"
SCALE_NOT_CHANNELWISE = "scale broadcasts along a non-channel dimension"
CHANGES_OUTPUT = "mul changes the conv output's shape or dtype"
TWIN_BEFORE_CALIBRATION = (
    "another conv computes the same product (same input, same weight) and the two"
    " results meet downstream other than in one sum that keeps each channel's sign:"
    " quantized, the two round alike, and where they combine that shared rounding may"
    " cancel, which separately folded weights would lose"
)
WEIGHT_BELOW_SCALE_FLOOR = (
    "folding shrinks a channel's weights below the smallest int8 weight scale Arm's"
    " quantizer allows (2^-16 per step), costing more than half an output step"
)
# Arm's symmetric quantization configs floor every observer scale at 2^-16.
MIN_WEIGHT_SCALE = 2.0**-16
INT8_MAX = 127
CHANNELS_MIXED = (
    "the layout between the layer and the multiply does not keep the channel axis whole"
)
NOT_QUANTIZED_LAYER = (
    "{op} is not annotated by the Arm quantizer (it has no int8 pattern, so it stays "
    "outside the delegate in float): there is no quantized layer to fold into"
)

# how an add or sub combines its two operands: +1 adds them, -1 subtracts one
_COMBINE_SIGNS = {torch.ops.aten.add.Tensor: 1, torch.ops.aten.sub.Tensor: -1}
_MULS = frozenset({torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar})


def _is_mul(node: Node) -> bool:
    return node.op == "call_function" and underlying_op(node.target) in _MULS


@dataclass(frozen=True)
class ConvScaleMatch:
    mul: Node
    conv: Node  # the layer: a convolution or a linear
    chain: tuple[Node, ...]  # layout / inference no-ops from the layer to the mul, layer side first
    weight: Node
    bias: Node | None
    scale_node: Node | None  # the scale's constant node, if it has one
    weight_tensor: torch.Tensor = field(compare=False)
    bias_tensor: torch.Tensor | None = field(compare=False)
    channel_scale: torch.Tensor = field(compare=False)  # [Cout], in the weight's dtype
    transposed: bool
    groups: int


def _out_channels(weight: torch.Tensor, transposed: bool, groups: int) -> int:
    return int(weight.shape[1]) * groups if transposed else int(weight.shape[0])


def is_transparent(node: object) -> bool:
    """A layout op or an inference no-op: it reorders or passes values, never mixes them."""
    if not isinstance(node, Node) or node.op != "call_function" or not node.args:
        return False
    if not isinstance(node.args[0], Node):
        return False
    return is_layout(node) or is_inference_noop(node)


def channel_axis_after(node: Node, axis: int) -> int | None:
    """The channel axis of `node`'s output, given it is `axis` of its input; None if mixed
    (or unknown: no static shapes)."""
    if is_layout(node):
        return axis_after_layout_op(node, axis)
    source = static_shape(node.args[0])
    return axis if source is not None and source == static_shape(node) else None


# ---- predicates: one per precondition ---------------------------------------


def _op_name(node: Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def is_allowed(pass_: ArmPass, *nodes: Node) -> bool:
    return all(pass_.allowed_to_transform(n.meta) for n in nodes)


def reaches_carried_state(conv: Node, mul: Node, region: frozenset[Node], chain=()) -> bool:
    return conv in region or mul in region or any(n in region for n in chain)


def has_single_user(conv: Node, mul: Node, chain: tuple[Node, ...] = ()) -> bool:
    readers = [*chain, mul]
    return all(
        len(node.users) == 1 and reader in node.users
        for node, reader in zip([conv, *chain], readers, strict=True)
    )


def has_shape_metadata(*nodes: Node) -> bool:
    return all(isinstance(node_value(n), torch.Tensor) for n in nodes)


def is_float_conv(pass_: ArmPass, conv: Node, mul: Node, weight: torch.Tensor) -> bool:
    quantized_meta = pass_._is_quantized_meta(conv.meta) or pass_._is_quantized_meta(mul.meta)
    return weight.is_floating_point() and not quantized_meta


def is_constant(tensor: torch.Tensor | None) -> bool:
    return tensor is not None


def is_constant_bias(bias: Node | None, bias_tensor: torch.Tensor | None) -> bool:
    return bias is None or (bias_tensor is not None and bias_tensor.is_floating_point())


def is_finite(scale: torch.Tensor) -> bool:
    return bool(torch.isfinite(scale).all())


def scaled_weight(
    weight: torch.Tensor, scale: torch.Tensor, transposed: bool, groups: int
) -> torch.Tensor:
    """`weight` with output channel c multiplied by scale[c] (transposed convs keep
    output channels on axis 1, per group)."""
    if not transposed:
        return weight * scale.reshape(-1, *([1] * (weight.dim() - 1)))
    grouped = weight.reshape(groups, weight.shape[0] // groups, *weight.shape[1:])
    return (grouped * scale.reshape(groups, 1, -1, *([1] * (weight.dim() - 2)))).reshape(
        weight.shape
    )


def _channel_peaks(weight: torch.Tensor, transposed: bool, groups: int) -> torch.Tensor:
    if not transposed:
        return weight.abs().flatten(1).amax(1)
    grouped = weight.abs().reshape(groups, weight.shape[0] // groups, weight.shape[1], -1)
    return grouped.amax(dim=(1, 3)).flatten()


def keeps_weight_precision(
    weight: torch.Tensor, scale: torch.Tensor, transposed: bool, groups: int
) -> bool:
    """No channel loses more to the int8 weight-scale floor than half an output step.

    Channel c's folded weights peak at P_c; int8 resolves them in steps of
    max(P_c / 127, 2^-16). The output's step follows the largest channel,
    roughly max(P) / 127 in the same units, so the floor costs channel c about
    (127 * 2^-16 - P_c) / 127 more than it should: decline when that passes half
    of max(P) / 127. A channel scaled to zero stays exact; one the fold does not
    shrink loses nothing it had.
    """
    before = _channel_peaks(weight.detach(), transposed, groups)
    after = _channel_peaks(
        scaled_weight(weight.detach(), scale, transposed, groups), transposed, groups
    )
    shrunk = (after > 0) & (after < before)
    cost = (INT8_MAX * MIN_WEIGHT_SCALE - after).clamp(min=0)
    return not bool((shrunk & (cost > after.max() / 2)).any())


def varies_only_along_channels(
    scale: torch.Tensor, output_shape: torch.Size, out_channels: int, channel_axis: int = 1
) -> bool:
    rank = len(output_shape)
    return rank >= 2 and channel_vector(scale, rank, channel_axis, out_channels) is not None


def keeps_conv_output(conv: Node, mul: Node) -> bool:
    conv_val, mul_val = node_value(conv), node_value(mul)
    return conv_val.shape == mul_val.shape and conv_val.dtype == mul_val.dtype


def channel_axis_at(arguments: ConvArguments, chain: tuple[Node, ...]) -> int | None:
    """The layer's output-channel axis as the multiply sees it, or None if the chain mixes it."""
    axis: int | None = arguments.output_channel_axis(node_value(arguments.node).dim())
    for node in chain:
        axis = channel_axis_after(node, axis)
        if axis is None:
            return None
    return axis


# ---- the pass ----------------------------------------------------------------


def layer_operand(mul: Node) -> tuple[Node, tuple[Node, ...], object] | None:
    """(layer, chain, scale) when one operand of `mul` is a conv or linear, directly or
    through transparent nodes (the chain, layer side first)."""
    for position in (0, 1):
        operand = mul.args[position] if len(mul.args) > position else None
        chain: list[Node] = []
        while is_transparent(operand):
            chain.append(operand)
            operand = operand.args[0]
        if isinstance(conv_arguments(operand), ConvArguments):
            return operand, tuple(reversed(chain)), mul.args[1 - position]
    return None


def conv_operand(mul: Node) -> tuple[Node, object] | None:
    """(layer, scale) when one operand of `mul` reaches a conv or linear (see layer_operand)."""
    found = layer_operand(mul)
    return None if found is None else (found[0], found[2])


class FoldScalarMulIntoConvPass(ArmPass):
    """L(layer(x, W, b)) * s -> L(layer(x, W * s, b * s)), s constant along out-channels (see module doc)."""

    _passes_required_after: set[type[ExportPass]] = set()

    def __init__(
        self, exported_program: ExportedProgram | None = None, tfa_pass: bool = False
    ) -> None:
        super().__init__(tfa_pass=tfa_pass)
        # upstream's ExportedProgram adapter sets this for each backend run
        self.exported_program = exported_program

    def _program_for(self, graph_module: GraphModule) -> ExportedProgram | None:
        program = self.exported_program
        return program if program is not None and program.graph_module is graph_module else None

    def _scale_tensor(self, scale, program: ExportedProgram | None) -> torch.Tensor | None:
        if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
            return torch.tensor(float(scale), dtype=torch.float64)
        if not isinstance(scale, Node):
            return None
        tensor = constant_tensor(scale, program)
        if tensor is None or tensor.is_complex() or tensor.dtype == torch.bool:
            return None
        return tensor

    def _scaled_twin(self, twin: Node, program) -> tuple[Node, torch.Tensor] | None:
        """(the twin's product, its finite scale): its single reader when that is a
        constant multiply straight on it, else the twin itself with scale 1."""
        if len(twin.users) != 1:
            return None
        reader = next(iter(twin.users))
        if not _is_mul(reader):
            return twin, torch.ones((), dtype=torch.float64)
        found = layer_operand(reader)
        if found is None or found[0] is not twin or found[1]:
            return None
        scale = self._scale_tensor(found[2], program)
        return (reader, scale) if scale is not None and is_finite(scale) else None

    def _twins_add_up(self, mul: Node, conv: Node, chain, scale: torch.Tensor, program) -> bool:
        """True when no twin's product meets this one (nothing combines the two, so the
        rounding they share cannot cancel), or when the one twin's product meets it in
        one add (or sub) where every channel's two scales keep their sign, so the shared
        rounding adds up instead of cancelling and separate roundings are no worse."""
        twins = twin_layers(conv)
        if not any(meet(mul, twin) for twin in twins):
            return True
        scaled = self._scaled_twin(twins[0], program) if len(twins) == 1 and not chain else None
        if scaled is None or len(mul.users) != 1:
            return False
        twin_product, twin_scale = scaled
        combine = next(iter(mul.users))
        sign = _COMBINE_SIGNS.get(underlying_op(combine.target))
        meets = set(combine.args[:2]) == {mul, twin_product} and len(twin_product.users) == 1
        if sign is None or not meets or combine.kwargs.get("alpha", 1) != 1:
            return False
        try:  # both broadcast against the conv output, so elementwise is per channel
            products = scale.detach().double() * twin_scale.detach().double()
        except RuntimeError:
            return False
        return bool((sign * products > 0).all())

    def match(
        self, mul: Node, region: frozenset[Node], program: ExportedProgram | None
    ) -> ConvScaleMatch | Declined | None:
        """The fold for `mul`, a Declined with the reason, or None when `mul` is not layer × something."""
        operands = layer_operand(mul)
        if operands is None:
            return None
        conv, chain, scale = operands
        arguments = conv_arguments(conv)

        if not is_allowed(self, conv):
            return Declined(NOT_QUANTIZED_LAYER.format(op=_op_name(conv)))
        if not is_allowed(self, mul):
            return Declined(DISALLOWED)
        carried = reaches_carried_state(conv, mul, region, chain)
        if carried and not _power_of_two_into_carried_state.get():
            return Declined(CARRIED_STATE)
        if not has_single_user(conv, mul, chain):
            return Declined(SEVERAL_USERS)
        operand = chain[-1] if chain else conv
        if not has_shape_metadata(conv, mul, *chain):
            return Declined(NO_SHAPE)

        weight = arguments.weight
        weight_tensor = constant_tensor(weight, program) if isinstance(weight, Node) else None
        if not is_constant(weight_tensor):
            return Declined(WEIGHT_NOT_CONSTANT)
        if not is_float_conv(self, conv, mul, weight_tensor):
            return Declined(QUANTIZED)
        bias = arguments.bias
        if bias is not None and not isinstance(bias, Node):
            return Declined(BIAS_NOT_CONSTANT)
        bias_tensor = constant_tensor(bias, program) if bias is not None else None
        if not is_constant_bias(bias, bias_tensor):
            return Declined(BIAS_NOT_CONSTANT)

        scale_tensor = self._scale_tensor(scale, program)
        if not is_constant(scale_tensor):
            return Declined(SCALE_NOT_CONSTANT)
        if not is_finite(scale_tensor):
            return Declined(SCALE_NOT_FINITE)
        if carried and not is_positive_power_of_two(scale_tensor):
            return Declined(CARRIED_STATE_NOT_POWER_OF_TWO)
        if self.is_tfa_pass and not self._twins_add_up(mul, conv, chain, scale_tensor, program):
            return Declined(TWIN_BEFORE_CALIBRATION)
        transposed, groups = arguments.transposed, arguments.groups
        out_channels = _out_channels(weight_tensor, transposed, groups)
        channel_axis = channel_axis_at(arguments, chain)
        if channel_axis is None:
            return Declined(CHANNELS_MIXED)
        output_shape = node_value(operand).shape
        if not varies_only_along_channels(scale_tensor, output_shape, out_channels, channel_axis):
            return Declined(SCALE_NOT_CHANNELWISE)
        if not keeps_conv_output(operand, mul):
            return Declined(CHANGES_OUTPUT)

        channel_scale = (
            scale_tensor.detach().to(weight_tensor.dtype).reshape(-1).expand(out_channels).clone()
        )
        if not keeps_weight_precision(weight_tensor, channel_scale, transposed, groups):
            return Declined(WEIGHT_BELOW_SCALE_FLOOR)
        if transposed:
            costly = per_channel_scale_into_transposed_conv(
                channel_scale, before_calibration=self.is_tfa_pass
            )
            if costly is not None:
                return costly
        if (costly := multiply_keeps_the_transpose(mul)) is not None:
            return costly
        return ConvScaleMatch(
            mul=mul,
            conv=conv,
            chain=chain,
            weight=weight,
            bias=bias,
            scale_node=scale if isinstance(scale, Node) else None,
            weight_tensor=weight_tensor,
            bias_tensor=bias_tensor,
            channel_scale=channel_scale,
            transposed=transposed,
            groups=groups,
        )

    def rewrite(
        self, graph_module: GraphModule, program: ExportedProgram | None, m: ConvScaleMatch
    ) -> str:
        scale = m.channel_scale
        folded_weight = scaled_weight(m.weight_tensor.detach(), scale, m.transposed, m.groups)
        digest = tensor_digest(scale, NAME_DIGEST_LENGTH)

        def stem(source: Node) -> str:
            return f"{source.target if source.op == 'get_attr' else source.name}_mul_{digest}"

        new_weight = create_constant(
            graph_module,
            program,
            like=m.weight,
            stem=stem(m.weight),
            data=folded_weight,
            reader=m.conv.name,
        )
        set_conv_argument(m.conv, "weight", new_weight)
        if m.bias is not None:
            folded_bias = m.bias_tensor.detach() * scale.to(m.bias_tensor.dtype)
            new_bias = create_constant(
                graph_module,
                program,
                like=m.bias,
                stem=stem(m.bias),
                data=folded_bias,
                reader=m.conv.name,
            )
            set_conv_argument(m.conv, "bias", new_bias)

        m.mul.replace_all_uses_with(m.chain[-1] if m.chain else m.conv)
        graph_module.graph.erase_node(m.mul)
        for source in (m.weight, m.bias, m.scale_node):
            if source is not None:
                delete_constant_if_unused(graph_module, program, source)
        return f"{'scalar' if scale.unique().numel() == 1 else 'per-channel'} scale folded: {m.weight.name} -> {new_weight.name}"

    def call(self, graph_module: GraphModule) -> PassResult:
        program = self._program_for(graph_module)
        graph = graph_module.graph
        muls = [n for n in graph.nodes if _is_mul(n)]
        if not muls:
            return PassResult(graph_module, False)
        region = carried_region(graph_module, program)
        pipeline = "annotation" if self.is_tfa_pass else "backend"
        modified = rewrite_each_match(
            muls,
            lambda mul: self.match(mul, region, program),
            lambda found: self.rewrite(graph_module, program, found),
            FOLD,
            where=lambda mul: f"{pipeline}:{layer_operand(mul)[0].name}",
        )
        if modified:
            graph.lint()
            graph_module.recompile()
        return PassResult(graph_module, modified)
