"""Fold a constant scale after a convolution into the convolution's weight and bias.

    conv(x, W, b) * s     (s: a number, a scalar tensor constant, or a constant
    s * conv(x, W, b)      broadcast over the conv output along channels only)
      -> conv(x, W', b * s)

    W' = W * s[:, None, ...]                      ordinary and grouped convs (out-channels lead W)
    W' = W.view(g, Cin/g, Cout/g, ...) * s.view(g, 1, Cout/g, 1, ...)
                                                   transposed convs (W is [Cin, Cout/g, ...])

Exact in real arithmetic; in fp32 each folded weight is rounded once, as is each
product in the unfolded graph. Runs before calibration in the annotation
pipeline (so INT quantization calibrates the folded conv) and in the backend
pipeline (FP profile). W', b * s are new constants named from their source and a
digest of s; the sources are removed only once nothing reads them, and no
existing tensor is written (the annotation pipeline's tensors are the user's).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch
from executorch.backends.arm._passes.arm_pass import ArmPass
from executorch.exir.dialects._ops import ops as exir_ops
from executorch.exir.pass_base import ExportPass
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from etfold.backends.arm._passes.carried_state import carried_region
from etfold.backends.arm._passes.graph_utils import (
    constant_tensor,
    create_constant,
    delete_constant_if_unused,
    fresh_constant_name,
    tensor_digest,
)
from etfold.decisions import Declined, record_applied, record_declined

FOLD = "arm.scalar_mul_into_conv"

DISALLOWED = "node is marked not to be transformed before annotation"
CARRIED_STATE = (
    "conv output reaches carried state (a written-back buffer or input, or a marked output)"
)
SEVERAL_USERS = "conv output has several users"
NO_SHAPE = "conv or mul has no shape metadata"
QUANTIZED = "conv is already quantized (fold runs before calibration for INT)"
WEIGHT_NOT_CONSTANT = "conv weight is not a constant"
BIAS_NOT_CONSTANT = "conv bias is not a constant"
SCALE_NOT_CONSTANT = "scale is not a constant"
SCALE_NOT_FINITE = "scale is not finite (NaN or Inf)"
SCALE_NOT_CHANNELWISE = "scale broadcasts along a non-channel dimension"
CHANGES_OUTPUT = "mul changes the conv output's shape or dtype"

_MULS = {
    torch.ops.aten.mul.Tensor,
    torch.ops.aten.mul.Scalar,
    exir_ops.edge.aten.mul.Tensor,
    exir_ops.edge.aten.mul.Scalar,
}


@dataclass(frozen=True)
class ConvSignature:
    """Where an overload keeps its bias and groups, and whether it transposes."""

    groups_index: int
    transposed: bool = False
    transposed_index: int | None = None  # the flag argument, for aten.convolution

    def is_transposed(self, conv: Node) -> bool:
        if self.transposed_index is None:
            return self.transposed
        return bool(_arg(conv, self.transposed_index, "transposed", False))


BIAS_INDEX = 2
_ATEN_CONV = ConvSignature(groups_index=6)
_ATEN_CONV_TRANSPOSE = ConvSignature(groups_index=6, transposed=True)
_CONVOLUTION = ConvSignature(groups_index=8, transposed_index=6)

_CONVS: dict[object, ConvSignature] = {
    torch.ops.aten.conv1d.default: _ATEN_CONV,
    torch.ops.aten.conv2d.default: _ATEN_CONV,
    torch.ops.aten.conv3d.default: _ATEN_CONV,
    torch.ops.aten.conv1d.padding: _ATEN_CONV,
    torch.ops.aten.conv2d.padding: _ATEN_CONV,
    torch.ops.aten.conv3d.padding: _ATEN_CONV,
    torch.ops.aten.conv_transpose1d.default: _ATEN_CONV_TRANSPOSE,
    torch.ops.aten.conv_transpose2d.input: _ATEN_CONV_TRANSPOSE,
    torch.ops.aten.conv_transpose3d.input: _ATEN_CONV_TRANSPOSE,
    torch.ops.aten.convolution.default: _CONVOLUTION,
    exir_ops.edge.aten.convolution.default: _CONVOLUTION,
}


@dataclass(frozen=True)
class ConvScaleMatch:
    mul: Node
    conv: Node
    weight: Node
    bias: Node | None
    scale_node: Node | None  # the scale's constant node, if it has one
    weight_tensor: torch.Tensor = field(compare=False)
    bias_tensor: torch.Tensor | None = field(compare=False)
    channel_scale: torch.Tensor = field(compare=False)  # [Cout], in the weight's dtype
    transposed: bool
    groups: int


def _arg(node: Node, index: int, name: str | None, default=None):
    if len(node.args) > index:
        return node.args[index]
    if name is not None and name in node.kwargs:
        return node.kwargs[name]
    return default


def _with_arg(node: Node, index: int, name: str, value) -> None:
    if len(node.args) > index:
        args = list(node.args)
        args[index] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, name: value}


def _out_channels(weight: torch.Tensor, transposed: bool, groups: int) -> int:
    return int(weight.shape[1]) * groups if transposed else int(weight.shape[0])


# ---- predicates: one per precondition ---------------------------------------


def is_allowed(pass_: ArmPass, *nodes: Node) -> bool:
    return all(pass_.allowed_to_transform(n.meta) for n in nodes)


def reaches_carried_state(conv: Node, mul: Node, region: frozenset[Node]) -> bool:
    return conv in region or mul in region


def has_single_user(conv: Node, mul: Node) -> bool:
    return len(conv.users) == 1 and mul in conv.users


def has_shape_metadata(*nodes: Node) -> bool:
    return all(isinstance(n.meta.get("val"), torch.Tensor) for n in nodes)


def is_float_conv(pass_: ArmPass, conv: Node, mul: Node, weight: torch.Tensor) -> bool:
    quantized_meta = pass_._is_quantized_meta(conv.meta) or pass_._is_quantized_meta(mul.meta)
    return weight.is_floating_point() and not quantized_meta


def is_constant(tensor: torch.Tensor | None) -> bool:
    return tensor is not None


def is_constant_bias(bias: Node | None, bias_tensor: torch.Tensor | None) -> bool:
    return bias is None or (bias_tensor is not None and bias_tensor.is_floating_point())


def is_finite(scale: torch.Tensor) -> bool:
    return bool(torch.isfinite(scale).all())


def varies_only_along_channels(
    scale: torch.Tensor, output_shape: torch.Size, out_channels: int
) -> bool:
    if scale.dim() > len(output_shape) or len(output_shape) < 2:
        return False
    padded = (1,) * (len(output_shape) - scale.dim()) + tuple(scale.shape)
    return all(size == 1 or (dim == 1 and size == out_channels) for dim, size in enumerate(padded))


def keeps_conv_output(conv: Node, mul: Node) -> bool:
    conv_val, mul_val = conv.meta["val"], mul.meta["val"]
    return conv_val.shape == mul_val.shape and conv_val.dtype == mul_val.dtype


# ---- the pass ----------------------------------------------------------------


def conv_operand(mul: Node) -> tuple[Node, object] | None:
    """(conv, scale) when one operand of `mul` is a convolution."""
    for position in (0, 1):
        operand = mul.args[position] if len(mul.args) > position else None
        if isinstance(operand, Node) and operand.op == "call_function" and operand.target in _CONVS:
            return operand, mul.args[1 - position]
    return None


class FoldScalarMulIntoConvPass(ArmPass):
    """conv(x, W, b) * s -> conv(x, W * s, b * s), s constant along out-channels (see module doc)."""

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

    def match(
        self, mul: Node, region: frozenset[Node], program: ExportedProgram | None
    ) -> ConvScaleMatch | Declined | None:
        """The fold for `mul`, a Declined with the reason, or None when `mul` is not conv × something."""
        operands = conv_operand(mul)
        if operands is None:
            return None
        conv, scale = operands
        signature = _CONVS[conv.target]

        if not is_allowed(self, conv, mul):
            return Declined(DISALLOWED)
        if reaches_carried_state(conv, mul, region):
            return Declined(CARRIED_STATE)
        if not has_single_user(conv, mul):
            return Declined(SEVERAL_USERS)
        if not has_shape_metadata(conv, mul):
            return Declined(NO_SHAPE)

        weight = _arg(conv, 1, "weight")
        weight_tensor = constant_tensor(weight, program) if isinstance(weight, Node) else None
        if not is_constant(weight_tensor):
            return Declined(WEIGHT_NOT_CONSTANT)
        if not is_float_conv(self, conv, mul, weight_tensor):
            return Declined(QUANTIZED)
        bias = _arg(conv, BIAS_INDEX, "bias")
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
        transposed = signature.is_transposed(conv)
        groups = int(_arg(conv, signature.groups_index, "groups", 1))
        out_channels = _out_channels(weight_tensor, transposed, groups)
        output_shape = conv.meta["val"].shape
        if not varies_only_along_channels(scale_tensor, output_shape, out_channels):
            return Declined(SCALE_NOT_CHANNELWISE)
        if not keeps_conv_output(conv, mul):
            return Declined(CHANGES_OUTPUT)

        channel_scale = (
            scale_tensor.detach().to(weight_tensor.dtype).reshape(-1).expand(out_channels).clone()
        )
        return ConvScaleMatch(
            mul=mul,
            conv=conv,
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
        weight, scale = m.weight_tensor.detach(), m.channel_scale
        if m.transposed:
            grouped = weight.reshape(m.groups, weight.shape[0] // m.groups, *weight.shape[1:])
            per_weight = scale.reshape(m.groups, 1, -1, *([1] * (weight.dim() - 2)))
            folded_weight = (grouped * per_weight).reshape(weight.shape)
        else:
            folded_weight = weight * scale.reshape(-1, *([1] * (weight.dim() - 1)))
        digest = tensor_digest(scale)

        def fresh(source: Node) -> str:
            base = f"{source.target if source.op == 'get_attr' else source.name}_mul_{digest}"
            return fresh_constant_name(graph_module, program, [base, f"{base}_{m.conv.name}"])

        new_weight = create_constant(
            graph_module, program, like=m.weight, name=fresh(m.weight), data=folded_weight
        )
        _with_arg(m.conv, 1, "weight", new_weight)
        if m.bias is not None:
            folded_bias = m.bias_tensor.detach() * scale.to(m.bias_tensor.dtype)
            new_bias = create_constant(
                graph_module, program, like=m.bias, name=fresh(m.bias), data=folded_bias
            )
            _with_arg(m.conv, BIAS_INDEX, "bias", new_bias)

        m.mul.replace_all_uses_with(m.conv)
        graph_module.graph.erase_node(m.mul)
        for source in (m.weight, m.bias, m.scale_node):
            if source is not None:
                delete_constant_if_unused(graph_module, program, source)
        return f"{'scalar' if scale.unique().numel() == 1 else 'per-channel'} scale folded: {m.weight.name} -> {new_weight.name}"

    def call(self, graph_module: GraphModule) -> PassResult:
        program = self._program_for(graph_module)
        graph = graph_module.graph
        muls = [n for n in graph.nodes if n.op == "call_function" and n.target in _MULS]
        if not muls:
            return PassResult(graph_module, False)
        region = carried_region(graph_module, program)
        pipeline = "annotation" if self.is_tfa_pass else "backend"
        modified = False
        for mul in muls:
            found = self.match(mul, region, program)
            if found is None:
                continue
            where = f"{pipeline}:{conv_operand(mul)[0].name}"
            if isinstance(found, Declined):
                record_declined(FOLD, where, found.reason)
                continue
            detail = self.rewrite(graph_module, program, found)
            record_applied(FOLD, where, detail)
            modified = True
        if modified:
            graph.lint()
            graph_module.recompile()
        return PassResult(graph_module, modified)
