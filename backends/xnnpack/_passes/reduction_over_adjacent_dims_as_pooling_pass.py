# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Write a mean or sum over adjacent dims as the pooling XNNPACK takes.

Given:   y = mean.dim(x, D, keepdim)  or  sum.dim_IntList(x, D, keepdim)
         x: [a..., r..., q...] contiguous, D the dims of r (adjacent; none given: all)
         A = prod(a), R = prod(r), Q = prod(q)
Result:  Q = 1:  m = mean.dim(view(x, [A, R]), [-1], keepdim=True)                [A, 1]
         Q > 1:  m = mean.dim(permute(view(x, [A, R, 1, Q]), [0, 3, 1, 2]), [2, 3],
                              keepdim=True)                                       [A, Q, 1, 1]
         y = view(m, shape(y))          (mean)
         y = view(m * R, shape(y))      (sum)

Both sides reduce the same R values for each of the A * Q outputs: a contiguous x
is exactly [A, R, Q] with the reduced values along the middle; the permute makes
each (a, q) a channel whose R values are the pooled plane. The view back gives
y's own shape (keepdim or not). For Q = 1 the mean over the last dim alone is the
form `mean_over_last_dim_as_pooling_pass` (which runs after this one) writes as
pooling; this pass declines what it would decline. The token mean of a ViT,
`x[:, 1:].mean(dim=1)` over [B, T, C], is the Q > 1 case: XNNPACK's pooling reads
NHWC, and [A, Q, R, 1] in NHWC is [A, R, 1, Q], x's own layout, so its layout
pass has no data to move back. Measured on the executorch 1.5.1 runtime, one
thread, a mean over dim 1 between two delegated ops ([1, 197, 384] and
[8, 64, 128]): 0.53x and 0.47x stock's time (stock: the mean on portable
kernels, two delegates).

An input that is not contiguous (a slice, `x[:, 1:]`) is copied contiguous with
`clone` first: the same values; once the slice is an Edge `slice_copy` the
clone keeps its dim order, which XNNPACK delegates as a copy.

Precision. The mean: the pooling sums in another order than eager, as every
delegated mean does (float32: within 1e-6 of eager in the tests). The sum:
`mean * R` rounds twice more than a sum (the pooling's multiply by 1/R, then by
R): at most 1.5 ulp of the result beyond the summation-order error, and none
when R is a power of two. This follows the standard of the project's float
rewrites (the layer norm and last-dim mean passes): within the runtime's own
tolerance against eager, the error stated here.

Symbolic sizes: XNNPACK's reshape infers one size at runtime, so each view may
hold one symbolic size (written -1); more is declined naming the dims. A sum
over a dynamic dim is declined: R would be a runtime number.

Declines: dims that are not adjacent, an explicit dtype, a 0-d result, an input
dtype XNNPACK does not compile the mean in here, a quantized input, a size that
may be 0, what the last-dim pass declines. Runs on the ATen program, before
decomposition.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from etfold.backends.xnnpack._passes.delegated_floats import (
    delegated_floats,
    dtype_taken,
    not_quantized,
)
from etfold.backends.xnnpack._passes.mean_over_last_dim_as_pooling_pass import (
    is_upstream_delegated,
    nonempty_for_every_size,
    one_inferred,
    rank_fits,
    viewable,
)
from etfold.decisions import Declined, first_declined, record_applied
from etfold.exir.passes.graph_walk import describe_axes, symbolic_axes
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import call_on_values, node_value

FOLD = "xnnpack.reduction_over_adjacent_dims_as_pooling"

aten = torch.ops.aten
REDUCTIONS = {aten.mean.dim: "mean", aten.sum.dim_IntList: "sum"}


@dataclass(frozen=True)
class Reduction:
    """What the pooling reduces: x's dims [first, last) of `rank`, keepdim or not."""

    first: int
    last: int
    rank: int
    keepdim: bool


@dataclass(frozen=True)
class ReductionAsPooling:
    node: torch.fx.Node
    kind: str  # "mean" or "sum"
    copied: bool  # x is copied contiguous first
    into: tuple[int, ...]  # the view of x: [A, R] or [A, R, 1, Q], one symbolic size as -1
    back: tuple[int, ...]  # y's shape, one symbolic size as -1
    count: int | None  # R, for a sum


def _argument(node: torch.fx.Node, index: int, name: str, default: object) -> object:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def reduced_block(node: torch.fx.Node, rank: int) -> Reduction | Declined:
    """The adjacent dims the reduction covers (all of them for none given)."""
    dims = _argument(node, 1, "dim", None)
    keepdim = bool(_argument(node, 2, "keepdim", False))
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return Reduction(0, rank, rank, keepdim)
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
        return Declined(f"reduces dims {dims!r}: not a list of ints")
    if rank == 0:
        return Declined("a 0-d input: XNNPACK takes no 0-d tensors")
    normalized = sorted({d % rank for d in dims})
    if normalized != list(range(normalized[0], normalized[-1] + 1)):
        return Declined(f"reduces dims {list(dims)}: not adjacent, no view brings them together")
    return Reduction(normalized[0], normalized[-1] + 1, rank, keepdim)


def not_the_last_dim_pass_own(kind: str, block: Reduction) -> bool:
    """A mean over the last dim alone is `mean_over_last_dim_as_pooling_pass`'s."""
    return not (kind == "mean" and block.first == block.rank - 1 and block.last == block.rank)


def has_no_dtype_override(node: torch.fx.Node) -> Declined | None:
    if node.kwargs.get("dtype") is not None:
        return Declined("an explicit dtype: XNNPACK's pooling has no dtype argument")
    return None


def output_not_0d(node: torch.fx.Node) -> Declined | None:
    if node_value(node).dim() == 0:
        return Declined("a 0-d result: XNNPACK takes no 0-d tensors")
    return None


def count_known(kind: str, value: torch.Tensor, block: Reduction) -> Declined | None:
    """A sum multiplies by R, which must be a number when lowering."""
    dynamic = [axis for axis in symbolic_axes(value) if block.first <= axis < block.last]
    if kind == "sum" and dynamic:
        return Declined(
            f"dynamic shape: {describe_axes(value, dynamic)}: a sum over it would multiply "
            "by a runtime size"
        )
    return None


def _blocks(value: torch.Tensor, block: Reduction) -> tuple:
    shape = tuple(value.shape)
    return (
        math.prod(shape[: block.first]),
        math.prod(shape[block.first : block.last]),
        math.prod(shape[block.last :]),
    )


def views(
    value: torch.Tensor, result: torch.Tensor, block: Reduction
) -> tuple[tuple, tuple] | Declined:
    """The view of x the pooling reads and the view back to y's shape, each with one
    size left for the runtime to infer, or why they cannot be written."""
    outer, reduced, inner = _blocks(value, block)
    last_dim = block.last == block.rank
    shape = (outer, reduced) if last_dim else (outer, reduced, 1, inner)
    into = one_inferred(value, shape, f"the {list(shape)} view")
    if isinstance(into, Declined):
        return into
    # with one symbolic size in [A, R], the last-dim pass's [1, A, 1, R] and [A, 1] views
    # hold one each too: it writes this mean as pooling
    back = one_inferred(result, tuple(result.shape), "the view back")
    return back if isinstance(back, Declined) else (into, back)


def match_reduction(
    node: torch.fx.Node, dtypes: Collection[torch.dtype]
) -> ReductionAsPooling | Declined | None:
    """The pooling `node` becomes, a reason it stays, or None when it is not ours to judge."""
    if node.op != "call_function" or node.target not in REDUCTIONS:
        return None
    kind, source = REDUCTIONS[node.target], node.args[0]
    value, result = node_value(source), node_value(node)
    if not isinstance(value, torch.Tensor) or not isinstance(result, torch.Tensor):
        return Declined("no tensor metadata on the reduction or its input")
    if kind == "mean" and is_upstream_delegated(node):
        return None
    block = reduced_block(node, value.dim())
    if isinstance(block, Declined):
        return block
    if not not_the_last_dim_pass_own(kind, block):
        return None
    declined = first_declined(
        lambda: rank_fits(value.dim(), keepdim=True),
        lambda: output_not_0d(node),
        lambda: has_no_dtype_override(node),
        lambda: dtype_taken(value, dtypes, kind),
        lambda: not_quantized(source, "the pooling would need quantization"),
        lambda: nonempty_for_every_size(source),
        lambda: count_known(kind, value, block),
    )
    if declined is not None:
        return declined
    written = views(value, result, block)
    if isinstance(written, Declined):
        return written
    count = _blocks(value, block)[1] if kind == "sum" else None
    copied = viewable(source) is not None
    return ReductionAsPooling(node, kind, copied, *written, count)


def _insert(anchor: torch.fx.Node, target, *args, **kwargs) -> torch.fx.Node:
    """`target(*args, **kwargs)` before `anchor`, with `anchor`'s metadata and its own value
    (every target here is a view or a reduction: none fixes a symbolic size)."""
    with anchor.graph.inserting_before(anchor):
        return call_on_values(anchor.graph, target, args, kwargs, meta=anchor.meta)


def rewrite_as_pooling(match: ReductionAsPooling) -> None:
    """The reduction becomes the views and mean of the module docstring."""
    node, x = match.node, match.node.args[0]
    if match.copied:
        x = _insert(node, aten.clone.default, x, memory_format=torch.contiguous_format)
    flat = _insert(node, aten.view.default, x, list(match.into))
    if len(match.into) == 2:
        mean = _insert(node, aten.mean.dim, flat, [-1], True)
    else:
        laid = _insert(node, aten.permute.default, flat, [0, 3, 1, 2])
        mean = _insert(node, aten.mean.dim, laid, [2, 3], True)
    if match.count is not None:
        mean = _insert(node, aten.mul.Tensor, mean, match.count)
    back = _insert(node, aten.view.default, mean, list(match.back))
    node.replace_all_uses_with(back)
    node.graph.erase_node(node)
    copy = ", its input copied contiguous first" if match.copied else ""
    where = "the last dim" if len(match.into) == 2 else "the pooled plane"
    record_applied(
        FOLD,
        node.name,
        f"{match.kind} over {list(match.into)} with the reduced values as {where}{copy}",
    )


def reductions_over_adjacent_dims_as_pooling(
    program: ExportedProgram, *, bf16: bool
) -> ExportedProgram:
    """`program`, or a rewritten copy where some mean or sum over adjacent dims is a pooling.

    `bf16`: whether XNNPACK compiles the mean (and a sum's multiply) in bf16 here."""
    match = functools.partial(match_reduction, dtypes=delegated_floats(bf16))
    return rewrite_matches_on_a_copy(program, match, rewrite_as_pooling, FOLD)
