# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Write a power with a small integer exponent as the multiplies (and one divide) it is.

Given:   y = pow.Tensor_Scalar(x, n)        x float; n an integer (or an integral float)
Result:  n =  3:   y = (x * x) * x
         n =  4:   s = x * x;  y = s * s
         n = -1:   y = 1 / x
         n = -2:   y = 1 / (x * x)
         (1: a 0-d constant of x's dtype)

Why: upstream's PowConfig takes the exponent 2 alone (XNNPACK's square), so GPT-2's
and ALBERT's `gelu_new`, `0.5 * x * (1 + tanh(c * (x + 0.044715 * pow(x, 3))))`,
leaves its `pow` on portable kernels and splits each MLP around it. Multiplies and
divides are XNNPACK ops.

Exactness, measured bit for bit against PyTorch 2.13's CPU `pow` over every finite
float16 and bfloat16 value and 6.3M float32 values (random bit patterns, normals,
uniforms); PyTorch computes 3, -1 and -2 as these very products, and other
exponents with `std::pow`:
- n = 3: float32 and bfloat16 bit-exact; float16 at most 1 ulp off (eager forms
  the cube in float32 and rounds it once; here x * x rounds to float16 first),
  12 % of values.
- n = 4: at most 2 ulp off in every dtype (two roundings against `std::pow`'s one).
- n = -1: bit-exact in every dtype.
- n = -2: float32 and bfloat16 bit-exact; float16 declined: x * x rounds into the
  subnormals, where 1 / (x * x) is up to 256 ulp off.
These follow the standard of the project's float rewrites (the layer norm and
mean-as-pooling passes): a result within the XNNPACK runtime's own tolerance
against eager counts as right, and the error is stated here. XNNPACK's float32
multiply and divide round correctly, so the float32 forms that are bit-exact in
PyTorch are bit-exact on the runtime too.

Declines: an exponent that is not an integer, or an integer outside {-2, -1, 3, 4}
(2 is left to upstream, which delegates it as XNNPACK's square); an input dtype
XNNPACK does not compile the multiplies in; -2 on float16; a quantized input.
Runs on the ATen program, before decomposition.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from etfold.backends.xnnpack._passes.delegated_floats import (
    delegated_floats,
    dtype_taken,
    not_quantized,
)
from etfold.decisions import Declined, first_declined, record_applied
from etfold.exir.passes.graph_walk import add_lifted_constant
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import node_value

FOLD = "xnnpack.pow_of_small_integer_as_multiplies"

aten = torch.ops.aten
EXPONENTS = (-2, -1, 3, 4)
UPSTREAM_EXPONENTS = (2,)  # upstream's PowConfig runs these as XNNPACK's square
INEXACT_IN = {-2: frozenset({torch.float16})}  # measured: see the module docstring


@dataclass(frozen=True)
class PowAsMultiplies:
    node: torch.fx.Node
    exponent: int


def integral_exponent(exponent: object) -> int | Declined:
    if isinstance(exponent, bool) or not isinstance(exponent, (int, float)):
        return Declined(f"exponent {exponent!r} is not a number known when lowering")
    if not float(exponent).is_integer():
        return Declined(f"exponent {exponent!r} is not an integer")
    return int(exponent)


def within_bound(exponent: int) -> Declined | None:
    if exponent not in EXPONENTS:
        shown = ", ".join(map(str, EXPONENTS))
        return Declined(f"exponent {exponent}: only {shown} are written as multiplies")
    return None


def exact_enough_in(exponent: int, dtype: torch.dtype) -> Declined | None:
    if dtype in INEXACT_IN.get(exponent, ()):
        return Declined(
            f"exponent {exponent} in {dtype}: x * x rounds into the subnormals, "
            "1 / (x * x) would be up to 256 ulp off"
        )
    return None


def match_pow(
    node: torch.fx.Node, dtypes: Collection[torch.dtype]
) -> PowAsMultiplies | Declined | None:
    """The multiplies `node` becomes, a reason it stays, or None when it is not ours."""
    if node.op != "call_function" or node.target is not aten.pow.Tensor_Scalar:
        return None
    source, value = node.args[0], node_value(node.args[0])
    if not isinstance(value, torch.Tensor):
        return Declined("no tensor metadata on the base")
    exponent = integral_exponent(node.args[1])
    if isinstance(exponent, Declined):
        return exponent
    if exponent in UPSTREAM_EXPONENTS:
        return None
    declined = first_declined(
        lambda: within_bound(exponent),
        lambda: dtype_taken(value, dtypes, "power"),
        lambda: exact_enough_in(exponent, value.dtype),
        lambda: not_quantized(source, "the multiplies would each need quantization"),
    )
    return declined if declined is not None else PowAsMultiplies(node, exponent)


def _insert(anchor: torch.fx.Node, target, *args) -> torch.fx.Node:
    """`target(*args)` before `anchor`, with `anchor`'s metadata and its own value."""
    with anchor.graph.inserting_before(anchor):
        node = anchor.graph.call_function(target, args)
    node.meta = {**anchor.meta, "val": target(*(node_value(a) for a in args))}
    return node


def rewrite_as_multiplies(match: PowAsMultiplies, program: ExportedProgram) -> None:
    node, x = match.node, match.node.args[0]
    magnitude, power = abs(match.exponent), x
    if magnitude >= 2:
        square = power = _insert(node, aten.mul.Tensor, x, x)
        if magnitude == 3:
            power = _insert(node, aten.mul.Tensor, square, x)
        elif magnitude == 4:
            power = _insert(node, aten.mul.Tensor, square, square)
    if match.exponent < 0:
        one = torch.ones((), dtype=node_value(x).dtype)
        constant = add_lifted_constant(program, f"_etfold_{node.name}_one", one)
        power = _insert(node, aten.div.Tensor, constant, power)
    node.replace_all_uses_with(power)
    node.graph.erase_node(node)
    record_applied(FOLD, node.name, f"x ** {match.exponent} as multiplies")


def pows_of_small_integers_as_multiplies(
    program: ExportedProgram, *, bf16: bool
) -> ExportedProgram:
    """`program`, or a rewritten copy where some power of a small integer is multiplies.

    `bf16`: whether XNNPACK compiles these multiplies (and divide) in bf16 here."""
    match = functools.partial(match_pow, dtypes=delegated_floats(bf16))
    copies: list[ExportedProgram] = []
    return rewrite_matches_on_a_copy(
        program,
        match,
        lambda found: rewrite_as_multiplies(found, copies[-1]),
        FOLD,
        on_copy=copies.append,
    )
