# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Write a layer norm over the last dim as the GEMMs and elementwise ops XNNPACK delegates.

Given:   y = layer_norm(x, [C], w, b, eps)         (or native_layer_norm(...)[0])
                                                   x: [s0, ..., C], float
Result:  a = full([1, C], 1 / C)                   a constant, one per GEMV
         m = linear(x, a)                          the row means, [s0, ..., 1]
         d = x - m
         v = linear(d * d, a)
         y = d * rsqrt(v + eps) * w + b            (`* w`, `+ b` only when given)

This is the definition layer norm computes: the biased variance of each row of
C values, `d` the row centred on its mean; a row mean is the dot product of the
row with a column of 1/C. ExecuTorch 1.5.1's XNNPACK partitioner has no layer
norm config, so every transformer block's norms stay on portable kernels and cut
the delegate around them; upstream delegates each op above. The means are GEMVs
rather than XNNPACK's 4-D pooling because pooling needs a view to [1, N, 1, C],
a transpose to NHWC and a view back around each mean: 6 more ops a norm, which
made the delegated norm slower than the portable one with its delegate boundary
on small rows (a 100 x 32 tied-logits head: 1.04x stock as pooling, 0.91x as
GEMVs). A GEMV takes any leading dims, symbolic ones included, as rows.
etfold's XnnpackDynamicallyQuantizedPartitioner leaves these GEMVs to the general
partitioner (`is_row_mean_column`); upstream's, listed before etfold's, takes every
fp32 linear one per delegate, these included, and so cuts the norm's delegate.

A norm over a symbolic width has no constant 1/C: its means stay `mean.dim`, which
`mean_over_last_dim_as_pooling_pass` then writes as pooling, so this pass runs before
it and declines what that pass would decline (a dtype the lowering does not run the
mean in, a view that would leave the runtime two symbolic sizes to infer). A pooled
input that is not contiguous (read through a transpose) is first copied contiguous
with `clone`, which Edge's `permute_copy` makes a no-op.

Precision (max |error| on the executorch 1.5.1 runtime, LayerNorm(1024), weight
U(0.5, 1.5), bias U(-0.5, 0.5), 4 rows of N(0.5, 1), seed 0; eager's own error
in brackets, against float32), the same as the pooled means gave:
- float32: 2.4e-6 against eager. 1/C is rounded to float32 when C is not a power
  of two: one more rounding of each product, within the GEMM's own.
- float16 / bfloat16 reach this pass in float32 when the partitioner delegates
  dtype converts (`widen_half_precision_ops_pass` computes them between two
  converts), so their statistics stay float32 inside the delegate: 3.1e-3 /
  2.1e-2 against eager float32 [3.1e-3 / 2.1e-2, one rounding], 9.8e-4 / 0
  against eager in the same dtype.
- Computed in float16 itself (converts not delegated): 6.1e-3 [3.1e-3], 3.9e-3
  against eager float16. Rewritten all the same: the portable float16 kernel it
  would otherwise stay on is 4.5-5.7 off eager.
- Computed in bfloat16 itself (enable_bf16, converts not delegated; Linear(64) →
  LayerNorm(64) → Linear(64)): 5.1e-3 against eager float32 [7.2e-3]; XNNPACK's
  bfloat16 GEMMs sum in float32. Where bfloat16 is not enabled it is declined.

Declines: a normalized shape other than the last dim alone, a native_layer_norm
whose mean or rstd output is used (training graphs), a quantized input, weight or
bias in another dtype than the input, a rank beyond XNNPACK's, an input that may
be empty, and the pooled means' declines above. Runs on the ATen program, before
decomposition.
"""

from __future__ import annotations

import functools
import operator
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
    nonempty_for_every_size,
    pooling_views,
    rank_fits,
    viewable,
)
from etfold.decisions import Declined, first_declined, record_applied
from etfold.exir.passes.graph_walk import add_lifted_constant
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import argument_values, node_value, rank_of

FOLD = "xnnpack.layer_norm_as_delegated_ops"

aten = torch.ops.aten
LAYER_NORMS = (aten.layer_norm.default, aten.native_layer_norm.default)
# the upstream configs the rewritten form needs; a symbolic width's pooled means also
# need POOLED_MEAN_TARGETS
POOLED_MEAN_TARGETS = ("mean.dim", "view_copy.default")
DELEGATED_TARGETS = (
    "linear.default",
    "sub.Tensor",
    "mul.Tensor",
    "add.Tensor",
    "rsqrt.default",
)


@dataclass(frozen=True)
class LayerNormOverLastDim:
    node: torch.fx.Node
    source: torch.fx.Node
    weight: torch.fx.Node | None
    bias: torch.fx.Node | None
    eps: float
    width: int | None  # None: symbolic, its means pooled
    copied: bool  # a pooled input, not contiguous (a transpose), is copied contiguous first


def _argument(node: torch.fx.Node, index: int, default: object = None) -> object:
    """Argument `index` of the op's schema, given positionally or by name."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(node.target._schema.arguments[index].name, default)


def over_last_dim_only(node: torch.fx.Node) -> Declined | None:
    normalized = _argument(node, 1)
    if not isinstance(normalized, (list, tuple)) or len(normalized) != 1:
        return Declined(
            f"normalizes over the last dims {normalized}: only a layer norm over the "
            "last dim alone is rewritten"
        )
    return None


def pooled_means_taken(
    value: torch.Tensor, pooled_means: bool, pooled_dtypes: Collection[torch.dtype]
) -> Declined | None:
    """A symbolic width has no constant 1/C: its means are `mean.dim`, which the mean
    pass writes as pooling; this declines what that pass would leave outside."""
    if not pooled_means:
        return Declined("symbolic width: its means need the mean.dim and view_copy configs")
    declined = dtype_taken(value, pooled_dtypes, "mean over a symbolic width")
    if declined is not None:
        return declined
    views = pooling_views(value, keepdim=True)
    return views if isinstance(views, Declined) else None


def only_the_output_used(node: torch.fx.Node) -> Declined | None:
    """native_layer_norm's mean and rstd outputs are read by training graphs only."""
    if node.target is aten.layer_norm.default:
        return None
    if any(user.target is not operator.getitem or user.args[1] != 0 for user in node.users):
        return Declined("its mean or rstd output is used (a training graph): kept whole")
    return None


def affine_in_input_dtype(node: torch.fx.Node, dtype: torch.dtype) -> Declined | None:
    for name, index in (("weight", 2), ("bias", 3)):
        value = argument_values(_argument(node, index))
        if value is not None and not isinstance(value, torch.Tensor):
            return Declined(f"no tensor metadata on the layer norm's {name}")
        if value is not None and value.dtype != dtype:
            return Declined(f"{name} in {value.dtype}, input in {dtype}")
    return None


def match_layer_norm(
    node: torch.fx.Node,
    dtypes: Collection[torch.dtype],
    pooled_means: bool = True,
    pooled_dtypes: Collection[torch.dtype] = delegated_floats(False),
) -> LayerNormOverLastDim | Declined | None:
    """The rewrite of `node`, a reason it stays, or None when it is not a layer norm."""
    if node.op != "call_function" or node.target not in LAYER_NORMS:
        return None
    source = node.args[0]
    rank = rank_of(source)
    if rank is None:
        return Declined("no tensor metadata on the layer norm's input")
    value = node_value(source)
    declined = first_declined(
        lambda: over_last_dim_only(node),
        lambda: only_the_output_used(node),
        lambda: not_quantized(source, "the rewritten ops would each need quantization"),
        lambda: dtype_taken(value, dtypes, "layer norm"),
        lambda: affine_in_input_dtype(node, value.dtype),
        lambda: rank_fits(rank, keepdim=True),
        lambda: nonempty_for_every_size(source),
    )
    if declined is not None:
        return declined
    width = _argument(node, 1)[0]
    if type(width) is not int:
        declined = pooled_means_taken(value, pooled_means, pooled_dtypes)
        if declined is not None:
            return declined
        width = None
    copied = width is None and viewable(source) is not None
    weight, bias, eps = _argument(node, 2), _argument(node, 3), _argument(node, 4, 1e-5)
    return LayerNormOverLastDim(node, source, weight, bias, eps, width, copied)


def _insert(anchor: torch.fx.Node, target, *args, **kwargs) -> torch.fx.Node:
    """`target(*args, **kwargs)` before `anchor`, with `anchor`'s metadata and its own value."""
    with anchor.graph.inserting_before(anchor):
        node = anchor.graph.call_function(target, args, kwargs)
    node.meta = {**anchor.meta, "val": target(*argument_values(args), **kwargs)}
    return node


def row_mean_column(width: int, dtype: torch.dtype) -> torch.Tensor:
    """The [1, width] weight of 1/width whose linear is the mean of each row."""
    return torch.full((1, width), 1.0 / width, dtype=dtype)


def is_row_mean_column(tensor: torch.Tensor) -> bool:
    """`tensor` is the weight of a row mean: a linear reading it is this pass's statistic."""
    return (
        tensor.dim() == 2
        and tensor.shape[0] == 1
        and tensor.is_floating_point()
        and torch.equal(tensor, row_mean_column(tensor.shape[1], tensor.dtype))
    )


def row_mean_weight(
    program: ExportedProgram, width: int, dtype: torch.dtype, reader: str
) -> torch.fx.Node:
    """A new row-mean column for one GEMV (`reader`). Never shared: a constant two
    delegates read is a weight neither lowered module can own (WavLM's norms fall in
    different delegates), and a column is C floats."""
    return add_lifted_constant(program, f"_etfold_{reader}_row_mean", row_mean_column(width, dtype))


def rewrite_as_delegated_ops(match: LayerNormOverLastDim, program: ExportedProgram) -> None:
    """The ops of the module docstring; the layer norm (and its getitems) go."""
    node, x = match.node, match.source
    if match.copied:
        x = _insert(node, aten.clone.default, x, memory_format=torch.contiguous_format)
    if match.width is None:

        def row_mean(rows: torch.fx.Node) -> torch.fx.Node:
            return _insert(node, aten.mean.dim, rows, [-1], True)
    else:
        dtype = node_value(x).dtype

        def row_mean(rows: torch.fx.Node) -> torch.fx.Node:
            column = row_mean_weight(program, match.width, dtype, f"{node.name}_{rows.name}")
            return _insert(node, aten.linear.default, rows, column)

    centred = _insert(node, aten.sub.Tensor, x, row_mean(x))
    variance = row_mean(_insert(node, aten.mul.Tensor, centred, centred))
    rstd = _insert(node, aten.rsqrt.default, _insert(node, aten.add.Tensor, variance, match.eps))
    y = _insert(node, aten.mul.Tensor, centred, rstd)
    if match.weight is not None:
        y = _insert(node, aten.mul.Tensor, y, match.weight)
    if match.bias is not None:
        y = _insert(node, aten.add.Tensor, y, match.bias)
    for user in [u for u in node.users if u.target is operator.getitem]:
        user.replace_all_uses_with(y)
        node.graph.erase_node(user)
    node.replace_all_uses_with(y)
    node.graph.erase_node(node)
    affine = "with" if match.weight is not None or match.bias is not None else "without"
    width = f"{match.width} values" if match.width else "a symbolic width, its means pooled"
    copy = ", its input copied contiguous first" if match.copied else ""
    record_applied(FOLD, node.name, f"over {width}, {affine} affine{copy}")


def layer_norms_as_delegated_ops(
    program: ExportedProgram, *, bf16: bool, pooled_means: bool = True, pooled_bf16: bool = False
) -> ExportedProgram:
    """`program`, or a rewritten copy when some layer norm becomes delegated ops.

    `bf16`: whether XNNPACK compiles every op of the rewritten form in bf16 here;
    `pooled_means`: whether the partitioner takes the pooled means of a symbolic width,
    `pooled_bf16` whether it takes them in bf16."""
    match = functools.partial(
        match_layer_norm,
        dtypes=delegated_floats(bf16),
        pooled_means=pooled_means,
        pooled_dtypes=delegated_floats(pooled_bf16),
    )
    copies = []
    return rewrite_matches_on_a_copy(
        program,
        match,
        lambda found: rewrite_as_delegated_ops(found, copies[-1]),
        FOLD,
        on_copy=copies.append,
    )
