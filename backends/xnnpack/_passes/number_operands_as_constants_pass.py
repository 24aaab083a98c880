# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Write a number operand the lowering would convert on every call as the constant it converts to.

Given:   y = op(x, s)          op: add, sub, mul, div (.Tensor, alpha 1); x a float tensor;
                               s a Python number with dtype(tensor(s)) != x.dtype
Result:  y = op(x, c)          c = tensor(s).to(x.dtype), a 0-d lifted constant

Why: ExecuTorch's edge lowering lifts a number operand into a 0-d constant
`tensor(s)`: int64 for an int, float32 for a float. When that is not x's dtype
(an int with a float32 x, any number with a float16 or bfloat16 x) it converts
the constant to x's dtype with `_to_dim_order_copy`, a convert XNNPACK never
takes for a constant, so the convert runs outside every delegate on every call
and the delegate reads its result as a runtime input. The decompositions of
pointwise ops write such numbers: hardsigmoid is `clamp(x + 3, 0, 6) / 6`,
and GPT-2's `gelu_new` adds 1 to a tanh.

Exact: c is the value that convert computes, once, when lowering; every op then
reads the same numbers as before.

Runs on the ATen program, before decomposition. When the lowering will decompose
a pointwise op whose decomposition writes such a number (found by tracing the
decomposition once on one-element samples), the program is decomposed with the
lowering's own table first and the rewrite runs on the result; when nothing is
rewritten the program comes back undecomposed.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from etfold.backends.xnnpack._passes.decomposed_first import decomposed_for
from etfold.decisions import record_applied
from etfold.exir.passes.graph_walk import add_lifted_constant, underlying_op
from etfold.exir.passes.inline_autocast_regions_pass import is_training_program
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import node_value

FOLD = "xnnpack.number_operand_as_constant"

aten = torch.ops.aten
NUMBER_OPERAND_OPS = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor})


@dataclass(frozen=True)
class NumberOperand:
    node: torch.fx.Node
    constant: torch.Tensor  # tensor(s).to(x.dtype), 0-d


def lifted_as(number: object) -> torch.Tensor | None:
    """The 0-d tensor ExecuTorch's edge lowering lifts a number operand into; None for
    anything that is not a plain number (a bool, a symbolic size, a tensor)."""
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        return None
    try:
        return torch.tensor(number)
    except RuntimeError:  # an int beyond int64: never lifted as one
        return None


def match_number_operand(node: torch.fx.Node) -> NumberOperand | None:
    """A binary op of a float tensor and a number the lowering would convert; None for
    anything else (the op is left exactly as it is: nothing is declined)."""
    if node.op != "call_function" or node.target not in NUMBER_OPERAND_OPS:
        return None
    if len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    value, lifted = node_value(node.args[0]), lifted_as(node.args[1])
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        return None
    if lifted is None or lifted.dtype == value.dtype:
        return None
    return NumberOperand(node, lifted.to(value.dtype))


def rewrite_number_operand(match: NumberOperand, program: ExportedProgram) -> None:
    node = match.node
    number = node.args[1]
    constant = add_lifted_constant(program, f"_etfold_{node.name}_number", match.constant)
    node.args = (node.args[0], constant)
    record_applied(FOLD, node.name, f"number {number!r} as a {match.constant.dtype} constant")


def _sample(argument: object) -> object:
    """A one-element tensor of a tensor argument's dtype and rank; any other argument as it
    is; a TypeError for one that cannot key the memo (a symbolic size, a list of nodes)."""
    if isinstance(argument, torch.fx.Node):
        value = node_value(argument)
        if not isinstance(value, torch.Tensor):
            raise TypeError(argument.name)
        return torch.zeros((1,) * value.dim(), dtype=value.dtype)
    hash(argument)
    return argument


def _key(sample: object) -> object:
    if isinstance(sample, torch.Tensor):
        return sample.dtype, sample.dim()
    return type(sample), sample


# (decomposition, argument dtypes, ranks and numbers) -> whether it writes such a number
_TRACED: dict = {}


def _traces_numbers(decomposition, args: tuple, kwargs: dict) -> bool:
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        traced = make_fx(functools.partial(decomposition, **kwargs))(*args)
    except Exception:  # it cannot run on samples: the program is decomposed to see
        return True
    return any(match_number_operand(node) is not None for node in traced.graph.nodes)


def decomposition_writes_numbers(node: torch.fx.Node, table: Mapping) -> bool:
    """A pointwise op whose decomposition in `table` writes a number operand the lowering
    would convert (hardsigmoid's `x + 3`; not silu's `x * sigmoid(x)`): traced once per
    decomposition, argument dtypes, ranks and numbers, on one-element samples."""
    op = underlying_op(node.target)
    if torch.Tag.pointwise not in getattr(op, "tags", ()) or op not in table:
        return False
    try:
        args = tuple(_sample(a) for a in node.args)
        kwargs = {name: _sample(value) for name, value in node.kwargs.items()}
    except TypeError:
        return True
    key = (table[op], tuple(map(_key, args)), tuple((k, _key(v)) for k, v in kwargs.items()))
    if key not in _TRACED:
        _TRACED[key] = _traces_numbers(table[op], args, kwargs)
    return _TRACED[key]


def number_operands_as_constants(
    program: ExportedProgram, decomposition_table: Mapping | None
) -> ExportedProgram:
    """`program`, or a rewritten copy (decomposed with `decomposition_table` where a
    pointwise op will be) in which each number the lowering would convert is a constant."""
    if is_training_program(program):  # left as it came, as every fold leaves one
        return program
    candidate = decomposed_for(
        program,
        decomposition_table,
        functools.partial(decomposition_writes_numbers, table=decomposition_table or {}),
    )
    copies: list[ExportedProgram] = []
    rewritten = rewrite_matches_on_a_copy(
        candidate,
        match_number_operand,
        lambda match: rewrite_number_operand(match, copies[-1]),
        FOLD,
        on_copy=copies.append,
    )
    return program if rewritten is candidate else rewritten
