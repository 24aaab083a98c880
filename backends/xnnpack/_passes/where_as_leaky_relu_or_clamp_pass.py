# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Write a `where` that selects between x and a function of x as the one op it computes.

Given:   y = where(x > 0, x, a * x)    (or x >= 0; or where(x < 0, a * x, x), x <= 0;
                                        a * x as x * a)                 a a number
Result:  y = leaky_relu(x, a)

Given:   y = where(x < c, c, x)        (or x <= c)                      c a number
Result:  y = clamp(x, min=c)
Given:   y = where(x > c, c, x)        (or x >= c)
Result:  y = clamp(x, max=c)
         (c: a number, a `full_like` / `zeros_like` / `scalar_tensor` fill of it)

Why: XNNPACK has no select, so each such `where` (a ViT head's
`torch.where(x > 0, x, 0.1 * x)`) leaves its comparison and select on portable
kernels and splits the delegate; XNNPACK runs leaky ReLU and clamp.

Exact, NaN and infinities included: leaky_relu(x, a) is x where x > 0 and a * x
elsewhere; at x = 0 (of either sign) the four leaky forms give x or a * x, both
zero, and a NaN gives NaN (a * NaN, or x) everywhere. A clamp to [c, inf) is x
where x >= c and c elsewhere, NaN for NaN, as `where(x < c, c, x)` is. The only
difference is the sign of a zero result (the runtime's leaky ReLU with a
negative slope gives +0 for +0, `a * x` gives -0; `x <= 0` with c = 0 gives +0
for -0): the numbers are equal. Measured on the executorch 1.5.1 runtime,
XNNPACK's leaky ReLU gives NaN for NaN as PyTorch's does, in every dtype; its
clamp does in float32 and bfloat16, but its float16 clamp gives a bound (as its
float16 relu and hardtanh, which upstream delegates, give 0 and -1).

Declines, each for a reason that is not a shape:
- `where(x > c, x, c)`, `where(x < c, x, c)` (and >=, <=): they give c for a NaN x,
  where clamp, and maximum/minimum, give NaN;
- `where(x > y, x, y)` of two tensors: NaN again (x NaN gives y), and XNNPACK's
  maximum does not propagate NaN either;
- a clamp form in float16: XNNPACK's float16 clamp loses NaN (above);
- in float16 / bfloat16, a number (slope, bound) that is not a value of the dtype:
  eager compares and multiplies with it unrounded, the runtime with it rounded;
- an input dtype XNNPACK does not compile the op in here; a quantized input.
Runs on the ATen program, before decomposition.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from etfold.backends.xnnpack._passes.delegated_floats import (
    delegated_floats,
    dtype_taken,
    exact_in,
    not_quantized,
)
from etfold.decisions import Declined, first_declined, record_applied
from etfold.exir.passes.constant_prop.verdicts import filled_with
from etfold.exir.passes.graph_walk import drop_unread
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import node_value

FOLD = "xnnpack.where_as_leaky_relu_or_clamp"

aten = torch.ops.aten
WHERES = frozenset({aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther})
GREATER = frozenset({aten.gt.Scalar, aten.ge.Scalar})
LESS = frozenset({aten.lt.Scalar, aten.le.Scalar})
TENSOR_COMPARISONS = frozenset({aten.gt.Tensor, aten.ge.Tensor, aten.lt.Tensor, aten.le.Tensor})
SCALINGS = frozenset({aten.mul.Tensor, aten.mul.Scalar})
OP_NAMES = {aten.leaky_relu.default: "leaky_relu", aten.clamp.default: "clamp"}
SYMBOL = {
    aten.gt.Scalar: ">",
    aten.ge.Scalar: ">=",
    aten.lt.Scalar: "<",
    aten.le.Scalar: "<=",
}


@dataclass(frozen=True)
class WhereAsOneOp:
    node: Node
    source: Node  # x
    target: object  # leaky_relu.default or clamp.default
    args: tuple  # after x
    form: str  # the user's form, for the decision


def plain_number(value: object) -> int | float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def branch_number(branch: object) -> int | float | None:
    """The number a where branch holds everywhere: a number, or a fill of one."""
    if isinstance(branch, Node):
        return filled_with(branch)
    return plain_number(branch)


def slope_of(branch: object, source: Node) -> int | float | None:
    """a, when `branch` is `source * a` or `a * source` with a a number."""
    if not isinstance(branch, Node) or branch.target not in SCALINGS:
        return None
    first, second = branch.args[:2]
    if first is source:
        return plain_number(second)
    return plain_number(first) if second is source else None


@dataclass(frozen=True)
class Comparison:
    source: Node
    op: object
    threshold: int | float


def comparison_of(condition: object) -> Comparison | None:
    if not isinstance(condition, Node) or condition.target not in SYMBOL:
        return None
    source, threshold = condition.args[:2]
    number = plain_number(threshold)
    if not isinstance(source, Node) or number is None:
        return None
    return Comparison(source, condition.target, number)


def selects_between_two_tensors(condition: object, chosen: object, other: object) -> bool:
    """`where(a > b, a, b)`-like: a comparison of two tensors selecting one of them."""
    if not isinstance(condition, Node) or condition.target not in TENSOR_COMPARISONS:
        return False
    return {id(chosen), id(other)} == {id(a) for a in condition.args[:2]}


def in_input_dtype(node: Node, dtype: torch.dtype) -> Declined | None:
    if node_value(node).dtype != dtype:
        return Declined(f"the where gives {node_value(node).dtype}, its input is {dtype}")
    return None


# measured on the executorch 1.5.1 runtime: XNNPACK's float16 clamp (relu and hardtanh
# alike) gives a bound for NaN (clamp(NaN, max=0.5) is -inf); float32 and bfloat16 give NaN
CLAMP_LOSES_NAN = frozenset({torch.float16})


def nan_kept(target: object, dtype: torch.dtype) -> Declined | None:
    if target is aten.clamp.default and dtype in CLAMP_LOSES_NAN:
        return Declined(
            f"XNNPACK's {dtype} clamp gives a bound for NaN, the where gives NaN: "
            "a clamp form stays a where in this dtype"
        )
    return None


def numbers_exact(numbers: tuple, dtype: torch.dtype) -> Declined | None:
    if dtype == torch.float32:
        return None
    for number in numbers:
        if not exact_in(number, dtype):
            return Declined(
                f"{number!r} is not a {dtype} value: eager compares or multiplies with it "
                "unrounded, the runtime with it rounded"
            )
    return None


def _leaky_or_clamp(node: Node, found: Comparison) -> WhereAsOneOp | Declined | None:
    """The one op this where computes, the NaN decline, or None when it is neither."""
    _, chosen, other = node.args[:3]
    x, op, t = found.source, found.op, found.threshold
    cmp = f"x {SYMBOL[op]} {t!r}"
    if t == 0 and op in GREATER and chosen is x and (a := slope_of(other, x)) is not None:
        return WhereAsOneOp(node, x, aten.leaky_relu.default, (a,), f"where({cmp}, x, {a!r} * x)")
    if t == 0 and op in LESS and other is x and (a := slope_of(chosen, x)) is not None:
        return WhereAsOneOp(node, x, aten.leaky_relu.default, (a,), f"where({cmp}, {a!r} * x, x)")
    if other is x and branch_number(chosen) == t:
        bounds = (t, None) if op in LESS else (None, t)
        return WhereAsOneOp(node, x, aten.clamp.default, bounds, f"where({cmp}, {t!r}, x)")
    if chosen is x and branch_number(other) == t:
        return Declined(
            f"where({cmp}, x, {t!r}) gives {t!r} for a NaN x; clamp and maximum give NaN"
        )
    return None


def match_where(node: Node, dtypes: Collection[torch.dtype]) -> WhereAsOneOp | Declined | None:
    """The op `node` becomes, a reason it stays, or None when it is not ours to judge."""
    if node.op != "call_function" or node.target not in WHERES:
        return None
    condition, chosen, other = node.args[:3]
    found = comparison_of(condition)
    if found is None:
        if selects_between_two_tensors(condition, chosen, other):
            return Declined(
                "a select between two tensors by their comparison gives the second for a "
                "NaN first; maximum and minimum give NaN, and XNNPACK's maximum does not"
            )
        return None
    result = _leaky_or_clamp(node, found)
    if not isinstance(result, WhereAsOneOp):
        return result
    value = node_value(found.source)
    if not isinstance(value, torch.Tensor) or not isinstance(node_value(node), torch.Tensor):
        return Declined("no tensor metadata on the where or its input")
    numbers = tuple(n for n in (found.threshold, *result.args) if n is not None)
    declined = first_declined(
        lambda: dtype_taken(value, dtypes, OP_NAMES[result.target]),
        lambda: in_input_dtype(node, value.dtype),
        lambda: nan_kept(result.target, value.dtype),
        lambda: numbers_exact(numbers, value.dtype),
        lambda: not_quantized(found.source, "the op would need quantization"),
    )
    return declined if declined is not None else result


def rewrite_as_one_op(match: WhereAsOneOp) -> None:
    node, graph = match.node, match.node.graph
    with graph.inserting_before(node):
        replacement = graph.call_function(match.target, (match.source, *match.args))
    replacement.meta = dict(node.meta)
    replaced = [a for a in node.args if isinstance(a, Node) and a is not match.source]
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)
    drop_unread(replaced)
    record_applied(FOLD, node.name, f"{match.form} as {OP_NAMES[match.target]}{match.args}")


def wheres_as_leaky_relu_or_clamp(program: ExportedProgram, *, bf16: bool) -> ExportedProgram:
    """`program`, or a rewritten copy where some where is a leaky ReLU or a clamp.

    `bf16`: whether XNNPACK compiles leaky ReLU and clamp in bf16 here."""
    match = functools.partial(match_where, dtypes=delegated_floats(bf16))
    return rewrite_matches_on_a_copy(program, match, rewrite_as_one_op, FOLD)
