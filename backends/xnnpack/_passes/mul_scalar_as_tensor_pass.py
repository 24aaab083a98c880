# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Write `mul.Scalar`, which XNNPACK refuses, as the `mul.Tensor` it takes.

Given:   y = mul.Scalar(x, s)          x: float32, float16 or bfloat16; s: a Python number
Result:  y = mul.Tensor(x, s)

`mul.Tensor` with a number operand is what `x * s` exports to. ExecuTorch's
edge passes lift `s` into a 0-d constant (`torch.tensor(s)`, float32) and, for
a half-precision `x`, convert that constant to `x`'s dtype (computed once when
lowering by `number_operands_as_constants_pass`); XNNPACK's multiply takes the
constant as a static operand. Upstream delegates only `mul.Tensor`.

Exactness. Eager multiplies by `float32(s)` and rounds the product once to x's
dtype (a number operand keeps float32 precision even for a half `x`).
- float32: the lifted constant is `float32(s)` itself: the same product, any s.
- float16 / bfloat16: the constant becomes `half(float32(s))`. When s is exactly
  representable in x's dtype that is s, and so is `float32(s)`; each product of
  two half values is exact in float32 (11 + 11 and 8 + 8 significant bits), so
  the delegate rounds the same exact product once, as eager does. Any other s
  would be rounded first and the product could differ: declined.

Where it runs. Programs rarely hold `mul.Scalar` before decomposition; the usual
source is decomposition itself: attention's math form scales q and k by
`sqrt(scale)` with `mul.Scalar`, after the partitioner's hooks have run, and
upstream forbids a partitioner to change the graph it tags. So on the ATen
program (the pre-decomposition hook), when an op that decomposes into
`mul.Scalar` will be decomposed, the program is decomposed with the lowering's
own table first (what upstream does next anyway) and the rewrite runs on the
result; when nothing is rewritten the program comes back undecomposed.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from etfold.backends.xnnpack._passes.decomposed_first import decomposed_for
from etfold.backends.xnnpack._passes.delegated_floats import (
    delegated_floats,
    dtype_taken,
    exact_in,
)
from etfold.decisions import Declined, record_applied
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import node_value

FOLD = "xnnpack.mul_scalar_as_tensor"

aten = torch.ops.aten
# measured on torch 2.13: their decomposition scales q and k with mul.Scalar
DECOMPOSE_INTO_MUL_SCALAR = frozenset(
    {
        aten.scaled_dot_product_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
)


@dataclass(frozen=True)
class MulScalarAsTensor:
    node: torch.fx.Node


def plain_number(scalar: object) -> Declined | None:
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)):
        return Declined(f"scalar {scalar!r} is not a plain number known when lowering")
    return None


def rounds_as_eager(scalar: float, dtype: torch.dtype) -> Declined | None:
    """The constant XNNPACK multiplies by is the number eager multiplies by (docstring)."""
    if dtype == torch.float32:
        return None
    if not exact_in(scalar, dtype):
        return Declined(
            f"scalar {scalar!r} is not exact in {dtype}: rounded first, the product could "
            "differ from eager's"
        )
    return None


def match_mul_scalar(
    node: torch.fx.Node, dtypes: Collection[torch.dtype]
) -> MulScalarAsTensor | Declined | None:
    """The rewrite of `node`, a reason it stays, or None when it is not ours to judge."""
    if node.op != "call_function" or node.target != aten.mul.Scalar:
        return None
    value = node_value(node.args[0])
    if not isinstance(value, torch.Tensor):
        return Declined("no tensor metadata on the multiplied input")
    scalar = node.args[1]
    for declined in (dtype_taken(value, dtypes, "multiply"), plain_number(scalar)):
        if declined is not None:
            return declined
    declined = rounds_as_eager(scalar, value.dtype)
    return declined if declined is not None else MulScalarAsTensor(node)


def rewrite_as_mul_tensor(match: MulScalarAsTensor) -> None:
    match.node.target = aten.mul.Tensor
    record_applied(FOLD, match.node.name, f"times {match.node.args[1]!r} as a constant operand")


def _makes_mul_scalar(node: torch.fx.Node) -> bool:
    return node.target in DECOMPOSE_INTO_MUL_SCALAR


def mul_scalars_as_tensors(
    program: ExportedProgram, decomposition_table: Mapping | None, *, bf16: bool
) -> ExportedProgram:
    """`program`, or a rewritten copy (decomposed with `decomposition_table` where that
    makes the mul.Scalar) when some mul.Scalar becomes mul.Tensor.

    `bf16`: whether XNNPACK takes a bf16 multiply in this lowering."""
    match = functools.partial(match_mul_scalar, dtypes=delegated_floats(bf16))
    candidate = decomposed_for(program, decomposition_table, _makes_mul_scalar)
    rewritten = rewrite_matches_on_a_copy(candidate, match, rewrite_as_mul_tensor, FOLD)
    return program if rewritten is candidate else rewritten
