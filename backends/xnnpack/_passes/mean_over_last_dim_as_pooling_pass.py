# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Write a mean over the last dim as the 4-D mean XNNPACK takes (global average pooling).

Given:   y = mean.dim(x, [r - 1], keepdim)          x: [s0, ..., s(r-2), C]
Result:  p = mean.dim(view(x, [1, N, 1, C]), [-2, -1], keepdim=True)     N = s0 * ... * s(r-2)
         y = view(p, [s0, ..., s(r-2), 1] if keepdim else [s0, ..., s(r-2)])

Both sides average the same C values for each of the N rows: a contiguous `x`
laid out as rows of C is exactly `[1, N, 1, C]`, whose last two dims hold one
row's C values, and the mean over them is taken once per row, as before. The
view back gives `y`'s own shape. RMSNorm's `x.pow(2).mean(-1, keepdim=True)` is
this op; upstream's MeanDimConfig takes only 4-D inputs reduced over the last
two dims with keepdim, so it leaves every RMSNorm's mean on portable kernels and
splits each decoder layer around it. Upstream delegates a static `view_copy`.

Symbolic sizes (a `torch.export.Dim` sequence): XNNPACK's static reshape takes
integer sizes and infers at most one of them at runtime (-1). So each view
writes its one symbolic size as -1: N when a leading dim is symbolic (C then
must be static), the output's one symbolic dim on the way back. A second
symbolic size in either view is declined, naming the dims; so is a dim whose
bounds admit 0 (XNNPACK takes no empty tensors).

The rows are the pooling's channels: XNNPACK's layout pass transposes the input
to [1, 1, C, N] (the output, [1, N, 1, 1], moves no data), and the pooling then
runs vectorized across rows. With the rows as batch and one channel ([N, 1, 1, C],
no transpose) it ran scalar: measured on 16 RMSNorm + linear blocks at [1, 32, 576],
that lowering was 1.05x stock's time, this one 0.96x.

Runs on the ATen program, before decomposition: `mean.dim` reaches the edge
program as `mean.dim`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from etfold.backends.xnnpack._passes.delegated_floats import (
    XNN_MAX_TENSOR_DIMS,
    delegated_floats,
    dtype_taken,
)
from etfold.decisions import Declined, first_declined, record_applied
from etfold.exir.passes.graph_walk import (
    describe_axes,
    known_contiguous,
    size_bounds,
    symbolic_axes,
)
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import is_last_axis, node_value, rank_of

FOLD = "xnnpack.mean_over_last_dim_as_pooling"

aten = torch.ops.aten


@dataclass(frozen=True)
class MeanOverLastDim:
    node: torch.fx.Node
    flat_shape: tuple[int, ...]  # [1, N, 1, C], the one symbolic size as -1
    back_shape: tuple[int, ...]  # the mean's own shape, its one symbolic size as -1


def _dims_and_keepdim(node: torch.fx.Node) -> tuple[object, bool]:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return dims, bool(keepdim)


def is_upstream_delegated(node: torch.fx.Node) -> bool:
    """A 4-D mean over dims 2 and 3 with keepdim: upstream's config and visitor take it."""
    dims, keepdim = _dims_and_keepdim(node)
    if rank_of(node.args[0]) != 4 or not isinstance(dims, (list, tuple)):
        return False
    return keepdim and sorted(d % 4 for d in dims) == [2, 3]


def reduces_last_dim_only(node: torch.fx.Node, rank: int) -> Declined | None:
    dims, _ = _dims_and_keepdim(node)
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or not is_last_axis(dims[0], rank):
        return Declined(f"reduces dims {dims}: only a mean over the last dim alone is rewritten")
    return None


def has_no_dtype_override(node: torch.fx.Node) -> Declined | None:
    if node.kwargs.get("dtype") is not None:
        return Declined("mean with an explicit dtype: XNNPACK's pooling has no dtype argument")
    return None


def rank_fits(rank: int, keepdim: bool) -> Declined | None:
    """The view back has rank `rank` (keepdim) or `rank - 1`, which XNNPACK must hold."""
    if rank > XNN_MAX_TENSOR_DIMS or rank - (not keepdim) < 1:
        return Declined(
            f"rank {rank} input (keepdim={keepdim}): the views would need "
            f"1 to {XNN_MAX_TENSOR_DIMS} dims"
        )
    return None


def nonempty_for_every_size(source: torch.fx.Node) -> Declined | None:
    """None when no size of `source` can be 0 within the export's bounds."""
    value = node_value(source)
    if symbolic_axes(value) == () and math.prod(value.shape) == 0:
        return Declined(f"empty input {list(value.shape)}: XNNPACK takes no empty tensors")
    empty = [axis for axis in symbolic_axes(value) if size_bounds(value.shape[axis])[0] < 1]
    if empty:
        return Declined(
            f"dynamic shape: {describe_axes(value, empty)} may be 0: XNNPACK takes no empty tensors"
        )
    return None


def viewable(source: torch.fx.Node) -> Declined | None:
    if not known_contiguous(node_value(source)):
        return Declined("input is not contiguous: the [1, N, 1, C] view would need a copy")
    return None


def one_inferred(value: torch.Tensor, shape, what: str) -> tuple[int, ...] | Declined:
    """`shape` with its one symbolic size written -1 (XNNPACK's reshape infers it at
    runtime); a decline naming `value`'s symbolic dims when there are more."""
    symbolic = [i for i, size in enumerate(shape) if type(size) is not int]
    if len(symbolic) > 1:
        return Declined(
            f"dynamic shape: {describe_axes(value, symbolic_axes(value))}: {what} would infer "
            f"{len(symbolic)} sizes; XNNPACK's reshape infers one"
        )
    return tuple(-1 if type(size) is not int else size for size in shape)


def pooling_views(
    value: torch.Tensor, keepdim: bool
) -> tuple[tuple[int, ...], tuple[int, ...]] | Declined:
    """The [1, N, 1, C] view of `value` and the view back to its mean's shape, each
    with at most one size left for the runtime to infer, or why they cannot be written."""
    shape = tuple(value.shape)
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    flat = one_inferred(value, (1, rows, 1, shape[-1]), "the [1, N, 1, C] view")
    if isinstance(flat, Declined):
        return flat
    back = one_inferred(value, (*shape[:-1], 1) if keepdim else shape[:-1], "the view back")
    return back if isinstance(back, Declined) else (flat, back)


def match_mean_over_last_dim(
    node: torch.fx.Node, dtypes: Collection[torch.dtype]
) -> MeanOverLastDim | Declined | None:
    """The pooling `node` becomes, a reason it stays, or None when it is not ours to judge."""
    if node.op != "call_function" or node.target != aten.mean.dim:
        return None
    source = node.args[0]
    rank = rank_of(source)
    if rank is None or rank_of(node) is None:
        return Declined("no tensor metadata on the mean or its input")
    if is_upstream_delegated(node):
        return None
    _, keepdim = _dims_and_keepdim(node)
    declined = first_declined(
        lambda: rank_fits(rank, keepdim),  # first: the others assume rank >= 1
        lambda: reduces_last_dim_only(node, rank),
        lambda: has_no_dtype_override(node),
        lambda: dtype_taken(node_value(source), dtypes, "mean"),
        lambda: nonempty_for_every_size(source),
        lambda: viewable(source),
    )
    if declined is not None:
        return declined
    views = pooling_views(node_value(source), keepdim)
    return views if isinstance(views, Declined) else MeanOverLastDim(node, *views)


def rewrite_as_pooling(match: MeanOverLastDim) -> None:
    """The mean node becomes the 4-D pooling; a view after it gives its users the old shape."""
    node, graph = match.node, match.node.graph
    source, before = node.args[0], node_value(node)
    flat_shape, back_shape = list(match.flat_shape), list(match.back_shape)
    with graph.inserting_before(node):
        flat = graph.call_function(aten.view.default, (source, flat_shape))
    flat.meta = {**node.meta, "val": node_value(source).view(flat_shape)}
    node.args, node.kwargs = (flat, [-2, -1], True), {}
    node.meta["val"] = node_value(flat).mean([-2, -1], keepdim=True)
    with graph.inserting_after(node):
        back = graph.call_function(aten.view.default, (node, back_shape))
    back.meta = {**node.meta, "val": before}
    node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
    rows, width = node_value(flat).shape[1], node_value(flat).shape[-1]  # [1, N, 1, C]
    record_applied(FOLD, node.name, f"mean over the last {width} values of {rows} rows")


def means_over_last_dim_as_pooling(program: ExportedProgram, *, bf16: bool) -> ExportedProgram:
    """`program`, or a rewritten copy when some mean over the last dim becomes a pooling.

    `bf16`: whether XNNPACK compiles this mean in bf16 for this lowering."""
    match = functools.partial(match_mean_over_last_dim, dtypes=delegated_floats(bf16))
    return rewrite_matches_on_a_copy(program, match, rewrite_as_pooling, FOLD)
