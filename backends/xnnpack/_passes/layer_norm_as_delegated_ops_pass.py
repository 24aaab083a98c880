# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Write a layer norm over the last dim as the elementwise ops and means XNNPACK delegates.

Given:   y = layer_norm(x, [C], w, b, eps)         (or native_layer_norm(...)[0])
                                                   x: [s0, ..., C], float32
Result:  m = mean.dim(x, [-1], keepdim=True)
         d = x - m
         v = mean.dim(d * d, [-1], keepdim=True)
         y = d * rsqrt(v + eps) * w + b            (`* w`, `+ b` only when given)

This is the definition layer norm computes: the biased variance of each row of
C values, `d` the row centred on its mean. ExecuTorch 1.5.1's XNNPACK
partitioner has no layer norm config, so every transformer block's norms stay
on portable kernels and cut the delegate around them; upstream delegates each
op above. The means have the form `mean_over_last_dim_as_pooling_pass` then
writes as XNNPACK's 4-D pooling, so this pass runs before it and declines what
that pass would decline (rank, a size that may be 0, a view that would leave the
runtime two symbolic sizes to infer). Symbolic sizes are otherwise taken: the
elementwise ops broadcast at runtime. An input that is not
contiguous (a norm over the channels of a conv's output, read through a
transpose) is first copied contiguous with `clone`: the same values, and once
the transpose is an Edge `permute_copy` the clone keeps its dim order, which
XNNPACK delegates as a no-op.

Precision (max |error| on the executorch 1.5.1 runtime, LayerNorm(1024) with
affine, 4 rows of N(0.5, 1); eager's own result in brackets, against float32):
- float32: 2.4e-6 against eager.
- float16 / bfloat16 reach this pass in float32 when the partitioner delegates
  dtype converts (`widen_half_precision_ops_pass` computes them between two
  converts), so their statistics stay float32 inside the delegate: 1.8e-3 /
  1.5e-2 against eager float32 [1.8e-3 / 1.5e-2, one rounding], 9.8e-4 / 0
  against eager in the same dtype.
- Computed in float16 itself (converts not delegated): 5.0e-3 [1.8e-3], 3.9e-3
  against eager float16. Rewritten all the same: the portable float16 kernel it
  would otherwise stay on is 4.5-5.7 off eager. bfloat16 itself is declined as
  a dtype: XNNPACK 1.5.1 has no bfloat16 mean.

Declines: a normalized shape other than the last dim alone, a native_layer_norm
whose mean or rstd output is used (training graphs), a quantized input, weight or
bias in another dtype than the input, and what the
mean pass declines. Runs on the ATen program, before decomposition.
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
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import argument_values, node_value, rank_of

FOLD = "xnnpack.layer_norm_as_delegated_ops"

aten = torch.ops.aten
LAYER_NORMS = (aten.layer_norm.default, aten.native_layer_norm.default)
# the upstream configs the rewritten form needs, the mean pass's view included
DELEGATED_TARGETS = (
    "mean.dim",
    "view_copy.default",
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
    copied: bool  # the input, not contiguous (a transpose), is copied contiguous first


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


def _views_written(views: tuple | Declined) -> Declined | None:
    """The mean pass must write both views of each rewritten mean, or this declines."""
    return views if isinstance(views, Declined) else None


def match_layer_norm(
    node: torch.fx.Node, dtypes: Collection[torch.dtype]
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
        lambda: _views_written(pooling_views(value, keepdim=True)),
    )
    if declined is not None:
        return declined
    eps = _argument(node, 4, 1e-5)
    copied = viewable(source) is not None
    return LayerNormOverLastDim(node, source, _argument(node, 2), _argument(node, 3), eps, copied)


def _insert(anchor: torch.fx.Node, target, *args, **kwargs) -> torch.fx.Node:
    """`target(*args, **kwargs)` before `anchor`, with `anchor`'s metadata and its own value."""
    with anchor.graph.inserting_before(anchor):
        node = anchor.graph.call_function(target, args, kwargs)
    node.meta = {**anchor.meta, "val": target(*argument_values(args), **kwargs)}
    return node


def rewrite_as_delegated_ops(match: LayerNormOverLastDim) -> None:
    """The ops of the module docstring; the layer norm (and its getitems) go."""
    node, x = match.node, match.source
    if match.copied:
        x = _insert(node, aten.clone.default, x, memory_format=torch.contiguous_format)
    mean = _insert(node, aten.mean.dim, x, [-1], True)
    centred = _insert(node, aten.sub.Tensor, x, mean)
    variance = _insert(
        node, aten.mean.dim, _insert(node, aten.mul.Tensor, centred, centred), [-1], True
    )
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
    copy = ", its input copied contiguous first" if match.copied else ""
    record_applied(FOLD, node.name, f"over {node_value(x).shape[-1]} values, {affine} affine{copy}")


def layer_norms_as_delegated_ops(program: ExportedProgram, *, bf16: bool) -> ExportedProgram:
    """`program`, or a rewritten copy when some layer norm becomes delegated ops.

    `bf16`: whether XNNPACK compiles every op of the rewritten form in bf16 here."""
    match = functools.partial(match_layer_norm, dtypes=delegated_floats(bf16))
    return rewrite_matches_on_a_copy(program, match, rewrite_as_delegated_ops, FOLD)
