# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Fold DyT's gamma/beta into the following convolution, exactly (TOSA INT).

Given a TABLE t (int8 codes, zero point z_t) feeding, through int32 MUL/ADD with
per-channel constants and RESCALEs, the int8 conv input y (zero point z_y), and
a conv with int8 weights W (zero point z_w) and int32 bias B:

    y[c] = f_c(t)                                       the integer chain, per channel
    acc[o] = B[o] + sum_{c,k} (W[o,c,k] - z_w) * (y[c] - z_y)

If on every code the TABLE can emit  f_c(t) - z_y == a_c * (t - z_t) + b_c  with
integers a_c, b_c (checked exactly, all channels at once), then

    acc[o] = B'[o] + sum_{c,k} (W'[o,c,k] - z_w) * (t[c] - z_t)
    W'[o,c,k] = (W[o,c,k] - z_w) * a_c + z_w
    B'[o]     = B[o] + sum_{c,k} (W[o,c,k] - z_w) * b_c

and the conv reads the TABLE directly: the accumulator is the same integer, so
the conv output is bit-identical. Between the affine and the conv may sit one
permute, one slice (its kept channels are read) and views that keep the channel
axis whole: upstream lowers a linear to a 1x1 conv between two `view_copy`, so
a DyT before a linear folds the same way. With padding the b_c term only holds where the
kernel window is inside the input, so a padded conv folds only when every b_c
is 0. A chain, or a prefix of it, that leaves every code the TABLE emits
unchanged is removed outright (identity by codes: its readers keep their own
zero points and read the same bytes), even where the layout is shared and no
fold into the conv is possible; the rest is kept. Runs after InsertTableOpsPass and before
RewriteConvPass.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from executorch.backends.arm._passes.quant_args import QuantArgs
from executorch.exir import ExportedProgram
from executorch.exir.pass_base import ExportPass
from torch.fx import GraphModule, Node

from etfold.backends.arm._passes.channel_vectors import channel_vector, conv_input_channels
from etfold.backends.arm._passes.constants import create_constant
from etfold.backends.arm._passes.conv_arguments import (
    NOT_A_LAYER,
    ConvArguments,
    conv_arguments,
    set_conv_argument,
)
from etfold.backends.arm._passes.dyt_match import (
    ADD,
    MUL,
    RESCALE,
    SLICE,
    TABLE,
    IntegerDyTFoldPass,
    constant_of,
    erase_unused,
    int32_constant_operand,
    rescale_of,
    single_qargs,
)
from etfold.backends.arm._passes.layout_axes import Layout, axis_before_layout_op, layout_kind
from etfold.backends.arm._passes.tosa_integer import (
    INT32_MAX,
    INT32_MIN,
    AffineFit,
    Rescale,
    fit_exact_integer_affine,
    fits_int32,
)
from etfold.decisions import Declined
from etfold.exir.passes.node_shapes import static_shape

FOLD = "arm.dyt_affine_into_conv"


# --- reading the site ----------------------------------------------------------


@dataclass(frozen=True)
class _Step:
    """One op of the chain from the TABLE to the conv input, in execution order."""

    node: Node
    rescale: Rescale | None = None  # a RESCALE step
    op: object = None  # MUL or ADD
    constant: torch.Tensor | None = None  # int64 operand values, own shape
    constant_nodes: tuple[Node, ...] = ()


@dataclass(frozen=True)
class _Layout:
    """Permute/slice/view nodes between the chain output and the conv, conv first."""

    nodes: tuple[Node, ...]
    chain_axis: int | None  # the chain's axis that becomes the conv's channel axis (None: mixed)
    channel_index: torch.Tensor | None  # conv input channel -> chain channel (None: identity)
    permutes: int
    slices: int


@dataclass(frozen=True)
class _Site:
    conv: Node
    arguments: ConvArguments | Declined  # Declined: groups or transposed not constants
    layout: _Layout
    output: Node  # the int8 RESCALE whose codes the conv reads
    table: Node
    steps: tuple[_Step, ...]


def _slice_index(node: Node, axis: int | None, index: torch.Tensor | None):
    """The chain channels a channel-axis slice keeps (composed with `index`); False: unreadable."""
    dim = int(node.args[1]) if len(node.args) > 1 else 0
    source_shape = static_shape(node.args[0])
    if source_shape is None:
        return False
    if axis is None or dim % len(source_shape) != axis:
        return index
    start, end, step = (list(node.args[2:5]) + [None, None, 1])[:3]
    if not all(v is None or type(v) is int for v in (start, end, step)):
        return False
    kept = torch.arange(source_shape[axis])[slice(start, end, step)]
    return kept if index is None else kept[index]


def _layout(conv: Node) -> _Layout | None:
    """Walk permutes, slices and views (a linear's reshape to a 1x1 conv) up from the conv."""
    node = conv.args[0]
    nodes: list[Node] = []
    axis: int | None = 1
    index: torch.Tensor | None = None
    permutes = slices = 0
    while layout_kind(node) in (Layout.PERMUTE, Layout.VIEW) or (
        isinstance(node, Node) and node.op == "call_function" and node.target == SLICE
    ):
        shape = static_shape(node)
        if shape is None or not isinstance(node.args[0], Node):
            return None
        if node.target == SLICE:
            slices += 1
            index = _slice_index(node, axis, index)
            if index is False:
                return None
        else:
            permutes += layout_kind(node) is Layout.PERMUTE
            axis = axis_before_layout_op(node, axis)
        nodes.append(node)
        node = node.args[0]
    if not isinstance(node, Node):
        return None
    return _Layout(tuple(nodes), axis, index, permutes, slices)


def _chain(
    output: Node, exported_program: ExportedProgram
) -> tuple[Node, tuple[_Step, ...]] | None:
    steps: list[_Step] = []
    node = output
    while isinstance(node, Node) and node.op == "call_function" and node.target != TABLE:
        if node.target == RESCALE:
            rescale = rescale_of(node)
            if rescale is None:
                return None
            steps.append(_Step(node, rescale=rescale))
            node = node.args[0]
        elif node.target in (MUL, ADD):
            if node.target == ADD and node.kwargs.get("alpha", 1) != 1:
                return None
            operands = [a for a in node.args[:2] if isinstance(a, Node)]
            if len(operands) != 2:
                return None
            constants = [int32_constant_operand(exported_program, a) for a in operands]
            if sum(c is not None for c in constants) != 1:
                return None
            k = 0 if constants[0] is not None else 1
            constant = constants[k]
            steps.append(
                _Step(
                    node,
                    op=node.target,
                    constant=constant.values,
                    constant_nodes=(*constant.nodes, constant.source),
                )
            )
            node = operands[1 - k]
        else:
            return None
    if not isinstance(node, Node) or node.target != TABLE:
        return None
    steps.reverse()
    return node, tuple(steps)


def _site(exported_program: ExportedProgram, conv: Node) -> _Site | None:
    arguments = _edge_convolution(conv)
    if arguments is None:
        return None
    layout = _layout(conv)
    if layout is None:
        return None
    output = layout.nodes[-1].args[0] if layout.nodes else conv.args[0]
    if rescale_of(output) is None:
        return None
    found = _chain(output, exported_program)
    if found is None:
        return None
    table, steps = found
    if not any(s.op is not None for s in steps):
        return None
    return _Site(conv, arguments, layout, output, table, steps)


def _edge_convolution(node: Node) -> ConvArguments | Declined | None:
    """The arguments of a conv call (not a linear: the backend has made those convs by
    now), a Declined when they are not constants, None for any other node."""
    arguments = conv_arguments(node)
    if isinstance(arguments, Declined):
        return None if arguments.reason == NOT_A_LAYER else arguments
    return None if arguments.linear else arguments


# --- predicates: each answers Declined(reason), or None when it holds -------------------


def conv_is_plain(site: _Site) -> Declined | None:
    if isinstance(site.arguments, Declined):
        return site.arguments
    if site.arguments.transposed:
        return Declined("the conv is transposed")
    return None


def alpha_is_in_the_table(site: _Site) -> Declined | None:
    """Proven (and tested against the reference model) only once alpha is in the TABLE:
    with the alpha multiply still feeding it, the rewrite has produced convs whose input
    channels the reference model rejects, so it fails closed there."""
    source = site.table.args[0]
    if rescale_of(source) is not None and getattr(source.args[0], "target", None) == MUL:
        return Declined("alpha is still a multiply before the TABLE (not folded into it)")
    return None


def layout_keeps_the_channel_axis(site: _Site) -> Declined | None:
    if site.layout.chain_axis is None:
        return Declined(
            "unsupported layout: a view between the affine and the conv splits or merges its channel axis"
        )
    return None


def layout_is_unambiguous(site: _Site) -> Declined | None:
    if site.layout.permutes > 1 or site.layout.slices > 1:
        return Declined(
            f"ambiguous layout provenance: {site.layout.permutes} permutes and {site.layout.slices} slices "
            "between the affine and the conv (at most one of each)"
        )
    return None


def layout_is_exclusive(site: _Site) -> Declined | None:
    """The conv's permute/slice must serve only it: they will carry TABLE codes."""
    readers = [site.conv, *site.layout.nodes][: len(site.layout.nodes)]
    for node, reader in zip(site.layout.nodes, readers, strict=True):
        if set(node.users) != {reader}:
            return Declined("the conv input is shared: its permute/slice has other users")
    return None


def table_is_int8_constant(exported_program: ExportedProgram, site: _Site) -> Declined | None:
    values = constant_of(exported_program, site.table.args[1]) if len(site.table.args) > 1 else None
    if values is None or values.dtype != torch.int8 or values.numel() != 256:
        return Declined("unsupported constant: the TABLE values are not a 256-entry int8 constant")
    return None


def quantization_lines_up(site: _Site) -> Declined | None:
    table_qargs = single_qargs(site.table, "output_qparams")
    first = site.steps[0]
    if table_qargs is None or table_qargs.dtype != torch.int8:
        return Declined("quantization metadata mismatch: the TABLE output is not int8 per-tensor")
    if first.rescale is None or first.rescale.input_zp != table_qargs.get_zp_per_tensor():
        return Declined(
            "quantization metadata mismatch: the TABLE zero point is not the chain's input zero point"
        )
    final = site.steps[-1].rescale
    if final is None or final.output_dtype != torch.int8:
        return Declined("quantization metadata mismatch: the affine output is not an int8 RESCALE")
    conv_in = (site.conv.meta.get("input_qparams") or {}).get(0)
    weight_q = (site.conv.meta.get("input_qparams") or {}).get(1)
    if not isinstance(conv_in, QuantArgs) or conv_in.per_channel or conv_in.dtype != torch.int8:
        return Declined("quantization metadata mismatch: the conv input is not int8 per-tensor")
    if not isinstance(weight_q, QuantArgs) or weight_q.dtype != torch.int8:
        return Declined("quantization metadata mismatch: the conv weight is not int8")
    if weight_q.per_channel and weight_q.axis != 0:
        return Declined(
            "quantization metadata mismatch: the conv weight is not quantized per output channel"
        )
    return None


def conv_zero_point_matches(site: _Site) -> Declined | None:
    conv_in = site.conv.meta["input_qparams"][0]
    if conv_in.get_zp_per_tensor() != site.steps[-1].rescale.output_zp:
        return Declined(
            f"conv input zero point {conv_in.get_zp_per_tensor()} differs from the affine output "
            f"zero point {site.steps[-1].rescale.output_zp}"
        )
    return None


def table_shape_is_conv_shape(site: _Site) -> Declined | None:
    table_shape, output_shape = static_shape(site.table), static_shape(site.output)
    if table_shape is None or table_shape != output_shape:
        return Declined("unsupported layout: the TABLE output is broadcast by the affine")
    return None


def constants_broadcast_along_channels(site: _Site, channels: int) -> list[torch.Tensor] | Declined:
    vectors = []
    for step in site.steps:
        if step.op is None:
            continue
        rank = len(static_shape(site.table))
        vector = channel_vector(step.constant, rank, site.layout.chain_axis, channels)
        if vector is None:
            return Declined(
                "unsupported layout: a gamma/beta constant varies along a non-channel axis"
            )
        vectors.append(vector)
    return vectors


@dataclass(frozen=True)
class _Evaluation:
    codes: torch.Tensor  # int64 [n], the distinct codes the TABLE emits
    boundaries: tuple[
        tuple[int, torch.Tensor], ...
    ]  # (step index, int8 codes [n, C]) after each int8 RESCALE
    clamped: bool


def evaluate_chain(
    site: _Site, table_values: torch.Tensor, vectors: list[torch.Tensor], channels: int
) -> _Evaluation | Declined:
    """Run the chain on every code the TABLE emits, per channel, as TOSA would."""
    codes = torch.unique(table_values.to(torch.int64))
    values = codes[:, None].expand(-1, channels)
    vector_iter = iter(vectors)
    boundaries = []
    clamped = False
    for index, step in enumerate(site.steps):
        if step.rescale is not None:
            if not step.rescale.in_range(values):
                return Declined(
                    "saturating map: a RESCALE input or result leaves the int32 range TOSA requires"
                )
            low, high = (
                torch.iinfo(step.rescale.output_dtype).min,
                torch.iinfo(step.rescale.output_dtype).max,
            )
            values = step.rescale.apply(values)
            if step.rescale.output_dtype == torch.int8:
                clamped = clamped or bool(((values == low) | (values == high)).any())
                boundaries.append((index, values))
        else:
            vector = next(vector_iter)[None, :]
            values = values * vector if step.op == MUL else values + vector
            if not fits_int32(values):
                return Declined("saturating map: the int32 gamma/beta arithmetic overflows")
    return _Evaluation(codes, tuple(boundaries), clamped)


def map_is_exactly_affine(
    site: _Site, evaluation: _Evaluation, read: torch.Tensor
) -> AffineFit | Declined:
    z_t = site.steps[0].rescale.input_zp
    z_y = site.steps[-1].rescale.output_zp
    fit = fit_exact_integer_affine(evaluation.codes - z_t, evaluation.boundaries[-1][1] - z_y)
    bad = (~fit.exact[read]).nonzero().reshape(-1)
    if bad.numel():
        why = "saturating" if evaluation.clamped else "nonlinear"
        return Declined(
            f"{why} map: TABLE code -> conv input code is not exactly affine on the "
            f"{evaluation.codes.numel()} codes the TABLE emits ({bad.numel()} of {read.numel()} channels)"
        )
    return fit


def padding_keeps_one_bias(site: _Site, fit: AffineFit, read: torch.Tensor) -> Declined | None:
    if site.arguments.padded and bool((fit.offsets[read] != 0).any()):
        return Declined("padded conv: beta's contribution at the border is not one bias")
    return None


@dataclass(frozen=True)
class _Conv:
    weight_node: Node
    bias_node: Node
    weight: torch.Tensor
    bias: torch.Tensor
    global_channels: torch.Tensor  # [O, I/g] chain channel read by weight[o, i]


def conv_constants_supported(
    exported_program: ExportedProgram, site: _Site, channels: int
) -> _Conv | Declined:
    weight_node, bias_node = site.arguments.weight, site.arguments.bias
    weight = constant_of(exported_program, weight_node)
    bias = constant_of(exported_program, bias_node)
    if weight is None or weight.dtype != torch.int8 or weight.dim() != 4:
        return Declined("unsupported constant: the conv weight is not a constant int8 4-D tensor")
    if bias is None or bias.dtype != torch.int32 or bias.shape != (weight.shape[0],):
        return Declined("unsupported constant: the conv bias is not a constant int32 vector")
    groups = site.arguments.groups
    out_channels, per_group = weight.shape[0], weight.shape[1]
    conv_in_channels = per_group * groups
    available = channels if site.layout.channel_index is None else site.layout.channel_index.numel()
    if out_channels % groups or conv_in_channels != available:
        return Declined(
            "unsupported layout: the conv's input channels do not line up with the affine's channels"
        )
    conv_channels = conv_input_channels(out_channels, per_group, groups)
    chain_channels = (
        conv_channels
        if site.layout.channel_index is None
        else site.layout.channel_index[conv_channels]
    )
    return _Conv(weight_node, bias_node, weight, bias, chain_channels)


def _weight_zero_points(site: _Site, out_channels: int) -> torch.Tensor:
    weight_q = site.conv.meta["input_qparams"][1]
    if weight_q.per_channel:
        return torch.tensor(weight_q.get_zp_per_channel(), dtype=torch.int64).reshape(
            out_channels, 1, 1, 1
        )
    return torch.tensor(weight_q.get_zp_per_tensor(), dtype=torch.int64)


def folded_constants_fit(
    site: _Site, conv: _Conv, fit: AffineFit
) -> tuple[torch.Tensor, torch.Tensor] | Declined:
    weight_q = site.conv.meta["input_qparams"][1]
    zero = _weight_zero_points(site, conv.weight.shape[0])
    centered = conv.weight.to(torch.int64) - zero
    slopes = fit.slopes[conv.global_channels][:, :, None, None]
    offsets = fit.offsets[conv.global_channels][:, :, None, None]
    weight = centered * slopes + zero
    if int(weight.min()) < weight_q.qmin or int(weight.max()) > weight_q.qmax:
        return Declined(
            f"folded int8 weights leave [{weight_q.qmin}, {weight_q.qmax}] (slopes up to {int(fit.slopes.abs().max())})"
        )
    bias = conv.bias.to(torch.int64) + (centered * offsets).sum(dim=(1, 2, 3))
    if int(bias.min()) < INT32_MIN or int(bias.max()) > INT32_MAX:
        return Declined("the folded int32 bias overflows")
    return weight.to(torch.int8), bias.to(torch.int32)


def identity_prefix(site: _Site, evaluation: _Evaluation) -> Node | None:
    """The last int8 RESCALE of the chain whose codes equal the TABLE's on every code
    it emits, if any (the whole chain included).

    Identity is by codes, not quantization parameters: readers of that RESCALE
    keep their own zero points and see the same bytes, so nothing else changes.
    """
    best = None
    for index, codes in evaluation.boundaries:
        if bool((codes == evaluation.codes[:, None]).all()):
            best = site.steps[index].node
    return best


# --- match / rewrite ----------------------------------------------------------


@dataclass(frozen=True)
class AffineIntoConvMatch:
    conv: Node
    table: Node
    output: Node  # replaced by the TABLE as the conv's (layout's) input
    layout: tuple[Node, ...]
    weight_node: Node
    bias_node: Node
    weight: torch.Tensor
    bias: torch.Tensor
    removed: tuple[Node, ...]  # chain nodes and constants, consumers first
    slopes: torch.Tensor
    offsets: torch.Tensor


@dataclass(frozen=True)
class IdentityGammaMatch:
    """An identity prefix of the chain (codes unchanged) goes; the rest stays.

    `reason_kept` says why the rest stays; empty when the whole chain is the
    identity and nothing stays.
    """

    conv: Node
    table: Node
    prefix_end: Node
    removed: tuple[Node, ...]
    reason_kept: str


def _identity_match(site: _Site, evaluation: _Evaluation) -> IdentityGammaMatch | None:
    prefix_end = identity_prefix(site, evaluation)
    if prefix_end is None:
        return None
    end = [s.node for s in site.steps].index(prefix_end)
    return IdentityGammaMatch(
        site.conv, site.table, prefix_end, _removed(site.steps[: end + 1]), reason_kept=""
    )


def _removed(steps: tuple[_Step, ...]) -> tuple[Node, ...]:
    nodes: list[Node] = []
    for step in reversed(steps):
        nodes.append(step.node)
        nodes.extend(step.constant_nodes)
    return tuple(nodes)


def match_affine_into_conv(
    exported_program: ExportedProgram, conv: Node
) -> AffineIntoConvMatch | IdentityGammaMatch | Declined | None:
    """None: no TABLE -> gamma/beta -> conv site. Declined: a site that must not fold."""
    site = _site(exported_program, conv)
    if site is None:
        return None
    for predicate in (conv_is_plain, alpha_is_in_the_table, quantization_lines_up):
        if (declined := predicate(site)) is not None:
            return declined
    if (declined := table_is_int8_constant(exported_program, site)) is not None:
        return declined
    for predicate in (table_shape_is_conv_shape, layout_keeps_the_channel_axis):
        if (declined := predicate(site)) is not None:
            return declined
    channels = static_shape(site.table)[site.layout.chain_axis]
    vectors = constants_broadcast_along_channels(site, channels)
    if isinstance(vectors, Declined):
        return vectors
    table_values = constant_of(exported_program, site.table.args[1])
    evaluation = evaluate_chain(site, table_values, vectors, channels)
    if isinstance(evaluation, Declined):
        return evaluation
    identity = _identity_match(site, evaluation)
    if identity is not None and identity.prefix_end is site.output:
        return identity
    folded = _fold_into_conv(exported_program, site, evaluation, channels)
    if isinstance(folded, Declined):
        return folded if identity is None else replace(identity, reason_kept=folded.reason)
    return folded


def _fold_into_conv(
    exported_program: ExportedProgram, site: _Site, evaluation: _Evaluation, channels: int
) -> AffineIntoConvMatch | Declined:
    """The whole chain into the conv's weight and bias, or why not (the layout and
    the conv's constants matter only here)."""
    for predicate in (layout_is_unambiguous, layout_is_exclusive, conv_zero_point_matches):
        if (declined := predicate(site)) is not None:
            return declined
    conv_constants = conv_constants_supported(exported_program, site, channels)
    if isinstance(conv_constants, Declined):
        return conv_constants
    read = torch.unique(conv_constants.global_channels)
    fit = map_is_exactly_affine(site, evaluation, read)
    if isinstance(fit, Declined):
        return fit
    if (declined := padding_keeps_one_bias(site, fit, read)) is not None:
        return declined
    folded = folded_constants_fit(site, conv_constants, fit)
    if isinstance(folded, Declined):
        return folded
    weight, bias = folded
    return AffineIntoConvMatch(
        conv=site.conv,
        table=site.table,
        output=site.output,
        layout=site.layout.nodes,
        weight_node=conv_constants.weight_node,
        bias_node=conv_constants.bias_node,
        weight=weight,
        bias=bias,
        removed=_removed(site.steps),
        slopes=fit.slopes[read],
        offsets=fit.offsets[read],
    )


def _fresh_constant(
    graph_module: GraphModule,
    exported_program: ExportedProgram,
    original: Node,
    conv: Node,
    data: torch.Tensor,
) -> Node:
    stem = f"{original.name}_dyt_folded_for_{conv.name}"
    return create_constant(graph_module, exported_program, like=original, stem=stem, data=data)


def rewrite_affine_into_conv(
    exported_program: ExportedProgram, graph_module: GraphModule, match: AffineIntoConvMatch
) -> None:
    conv = match.conv
    weight_node, bias_node = match.weight_node, match.bias_node
    if not torch.equal(match.weight, constant_of(exported_program, weight_node)):
        weight_node = _fresh_constant(
            graph_module, exported_program, weight_node, conv, match.weight
        )
    if not torch.equal(match.bias, constant_of(exported_program, bias_node)):
        bias_node = _fresh_constant(graph_module, exported_program, bias_node, conv, match.bias)
    reader = match.layout[-1] if match.layout else conv
    set_conv_argument(conv, "weight", weight_node)
    set_conv_argument(conv, "bias", bias_node)
    table_qargs = single_qargs(match.table, "output_qparams")
    reader.replace_input_with(match.output, match.table)
    node = conv.args[0]
    while node is not match.table:  # layout nodes now carry TABLE codes
        node.meta["input_qparams"] = {0: table_qargs}
        node.meta["output_qparams"] = {0: table_qargs}
        node = node.args[0]
    # The integer accumulator is unchanged, so the conv keeps its input scale;
    # only the zero point it subtracts is now the TABLE's.
    conv_qparams = dict(conv.meta["input_qparams"])
    conv_qparams[0] = conv_qparams[0]._replace(zp=table_qargs.get_zp_per_tensor())
    conv.meta["input_qparams"] = conv_qparams
    erase_unused(
        graph_module, exported_program, (*match.removed, match.weight_node, match.bias_node)
    )


def rewrite_identity_gamma(
    graph_module: GraphModule, exported_program: ExportedProgram, match: IdentityGammaMatch
) -> None:
    match.prefix_end.replace_all_uses_with(match.table)
    erase_unused(graph_module, exported_program, match.removed)


class FoldDyTAffineIntoConvPass(IntegerDyTFoldPass):
    """`conv(f(TABLE))` with f exactly affine per channel -> `conv'(TABLE)`; see the module docstring."""

    FOLD = FOLD
    _passes_required_after: set[type[ExportPass]] = set()

    def match(self, node: Node) -> AffineIntoConvMatch | IdentityGammaMatch | Declined | None:
        return match_affine_into_conv(self.exported_program, node)

    def rewrite(
        self, graph_module: GraphModule, match: AffineIntoConvMatch | IdentityGammaMatch
    ) -> str:
        if isinstance(match, IdentityGammaMatch):
            rewrite_identity_gamma(graph_module, self.exported_program, match)
            if not match.reason_kept:
                return "removed gamma/beta: their codes equal the TABLE's"
            return f"removed the identity gamma, kept beta ({match.reason_kept})"
        rewrite_affine_into_conv(self.exported_program, graph_module, match)
        return (
            f"gamma/beta folded into conv weight and bias (slopes {sorted(set(match.slopes.tolist()))}, "
            f"{int((match.offsets != 0).sum())} channels with an offset)"
        )
