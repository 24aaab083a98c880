# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A conv's output cut short at its end, as the conv padding less at that end.

Given:   y = slice(conv(x, w, b, stride, padding, dilation, groups), d, 0, n - k)
                                          d a spatial dim of n outputs, k known
Result:  y = conv(constant_pad_nd(x, p before and p - k * s after along d), w, b,
                  stride, padding with 0 along d, dilation, groups)

Output i of a conv along d reads the padded input from i * s on, for a kernel's
extent, whatever lies after it: the last k outputs are the only ones that read the
last k * s padded positions, so padding k * s fewer at the end drops exactly them,
and every other output computes from the same values.

Why: causal convolutions pad both ends and cut the tail (`conv(x)[..., :-k]`), and
wav2vec2's positional conv (an even kernel, transformers' `SamePad`) drops its last
output. On a dynamic time axis that slice ends at a symbolic
position, which XNNPACK's slice cannot take: the encoder splits around it. The pad
joins the delegate (XNNPACK pads float32).

Declines: padding after the end short of k * s; a conv something else reads; a
quantized input; a dtype XNNPACK does not pad. Left alone: transposed convs, a slice
that does not start at 0 or steps, a cut whose length is not known when lowering.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
from torch.export import ExportedProgram
from torch.fx import Node

from etfold.backends.xnnpack._passes.delegated_floats import dtype_taken, not_quantized
from etfold.backends.xnnpack._passes.dynamic_slices import slice_arguments
from etfold.decisions import Declined, first_declined, record_applied
from etfold.exir.passes.graph_walk import drop_unread
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import node_value

FOLD = "xnnpack.conv_tail_slices_as_padding"

aten = torch.ops.aten
CONVS = {aten.conv1d.default, aten.conv2d.default, aten.convolution.default}
STRIDE_AT, PADDING_AT = 3, 4  # in all three schemas: (input, weight, bias, stride, padding, ..)


@dataclass(frozen=True)
class ConvTail:
    cut: Node  # the slice
    conv: Node
    spatial: int  # index of the sliced dim among the spatial dims
    dropped: int  # k: outputs cut from the end


def _per_dim(value, dims: int) -> list[int]:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return values * dims if len(values) == 1 else values


def _spatial_dims(conv: Node) -> int:
    return node_value(conv).dim() - 2


def conv_arguments(conv: Node) -> list:
    """The conv node's positional arguments through padding, defaults filled in, stride
    and padding per spatial dim."""
    args = list(conv.args[: PADDING_AT + 1])
    args += [None, [1], [0]][len(args) - 2 :]
    dims = _spatial_dims(conv)
    args[STRIDE_AT], args[PADDING_AT] = (_per_dim(args[i], dims) for i in (STRIDE_AT, PADDING_AT))
    return args


def _is_plain_conv(node: object) -> bool:
    """A conv1d/conv2d/convolution node, not transposed, all arguments by position."""
    if not isinstance(node, Node) or node.target not in CONVS or node.kwargs:
        return False
    return node.target is not aten.convolution.default or node.args[6] is False


def _known_difference(a: object, b: object) -> int | None:
    """a - b when it is one integer at every size; else None."""
    exprs = [s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(s) for s in (a, b)]
    difference = sympy.simplify(exprs[0] - exprs[1])
    return int(difference) if difference.is_Integer else None


def _tail(cut: Node) -> tuple[Node, int, int] | None:
    """(conv, sliced dim, outputs dropped) when `cut` keeps a conv's leading outputs."""
    if cut.op != "call_function" or cut.target is not aten.slice.Tensor:
        return None
    conv = cut.args[0]
    if not _is_plain_conv(conv):  # conv1d.padding ("same") and transposed convs left out
        return None
    dim, start, _, step = slice_arguments(cut)
    dim %= node_value(conv).dim()
    if type(start) is not int or start != 0 or step != 1 or dim < 2:
        return None
    dropped = _known_difference(node_value(conv).shape[dim], node_value(cut).shape[dim])
    if not dropped:  # unknown, or nothing dropped
        return None
    return conv, dim, dropped


def match_conv_tail(node: Node) -> ConvTail | Declined | None:
    found = _tail(node)
    if found is None:
        return None
    conv, dim, dropped = found
    spatial = dim - 2
    arguments = conv_arguments(conv)
    stride, padding = arguments[STRIDE_AT], arguments[PADDING_AT]
    needed = dropped * stride[spatial]
    declined = first_declined(
        lambda: (
            Declined("something else reads the conv's whole output")
            if len(conv.users) > 1
            else None
        ),
        lambda: not_quantized(conv.args[0], "the pad before the conv would need quantizing"),
        lambda: dtype_taken(node_value(conv.args[0]), {torch.float32}, "pad"),
        lambda: (
            Declined(
                f"padding {padding[spatial]} after the end, short of the {needed} the cut drops"
            )
            if padding[spatial] < needed
            else None
        ),
    )
    return declined if declined is not None else ConvTail(node, conv, spatial, dropped)


def _padded_value(source: torch.Tensor, dim: int, added: int) -> torch.Tensor:
    """`source`'s fake value `added` longer along `dim`, built from its sizes: running the
    pad on fake values specializes a symbolic size (measured: torch 2.13 retraces the
    program at the traced length)."""
    shape = list(source.shape)
    shape[dim] = shape[dim] + added
    return source.new_empty(shape)


def rewrite_conv_tail(match: ConvTail) -> None:
    cut, conv, graph = match.cut, match.conv, match.cut.graph
    arguments = conv_arguments(conv)
    padding, spatial = arguments[PADDING_AT], match.spatial
    after = padding[spatial] - match.dropped * arguments[STRIDE_AT][spatial]
    pad = [0, 0] * (_spatial_dims(conv) - 1 - spatial) + [padding[spatial], after]
    source = conv.args[0]
    with graph.inserting_before(conv):
        padded = graph.call_function(aten.constant_pad_nd.default, (source, pad))
        padded.meta["val"] = _padded_value(
            node_value(source), 2 + spatial, padding[spatial] + after
        )
        arguments[0] = padded
        arguments[PADDING_AT] = [0 if i == spatial else p for i, p in enumerate(padding)]
        shorter = graph.call_function(conv.target, (*arguments, *conv.args[PADDING_AT + 1 :]))
    shorter.meta = {**conv.meta, "val": node_value(cut)}
    cut.replace_all_uses_with(shorter)
    drop_unread([cut])
    record_applied(
        FOLD,
        conv.name,
        f"{match.dropped} output(s) fewer: padding {after} after the end, not {padding[spatial]}",
    )


def conv_tail_slices_as_padding(program: ExportedProgram) -> ExportedProgram:
    """`program`, or a rewritten copy where some conv pads less instead of a cut output."""
    return rewrite_matches_on_a_copy(program, match_conv_tail, rewrite_conv_tail, FOLD)
