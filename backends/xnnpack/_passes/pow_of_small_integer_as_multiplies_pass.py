# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Write a power with a small integer exponent as the multiplies it is.

Given:   y = pow.Tensor_Scalar(x, n)        x float; n an integer (or an integral float)
Result:  n = 3:   y = (x * x) * x
         n = 4:   s = x * x;  y = s * s

Why: upstream's PowConfig takes the exponent 2 alone (XNNPACK's square), so GPT-2's
and ALBERT's `gelu_new`, `0.5 * x * (1 + tanh(c * (x + 0.044715 * pow(x, 3))))`,
leaves its `pow` on portable kernels and splits each MLP around it. Multiplies are
XNNPACK ops.

Exactness, measured bit for bit against PyTorch 2.13's CPU `pow` over every finite
float16 and bfloat16 value and 6.3M float32 values (random bit patterns, normals,
uniforms); PyTorch computes the cube as these very products, and the fourth power
with `std::pow`:
- n = 3: float32 and bfloat16 bit-exact; float16 at most 1 ulp off (eager forms
  the cube in float32 and rounds it once; here x * x rounds to float16 first),
  12 % of values.
- n = 4: at most 2 ulp off in every dtype (two roundings against `std::pow`'s one).
On the executorch 1.5.1 runtime XNNPACK's float32 multiply rounds correctly, so the
float32 cube is eager's bit for bit, except that XNNPACK flushes subnormal results
to zero, as it does in every op it runs: a cube below 1.2e-38 in magnitude comes
out 0 where eager keeps the subnormal (an absolute error under 1.2e-38). The
unrewritten program's portable `pow` computes with `std::pow`: the cube here is
within 1 ulp of it.
These follow the standard of the project's float rewrites (the layer norm and
mean-as-pooling passes): a result within the XNNPACK runtime's own tolerance
against eager counts as right, and the error is stated here.

Negative exponents are declined: 1 / x would run on XNNPACK, which flushes a
subnormal x to zero, so x^-1 of a subnormal would be infinite where eager gives a
finite value (measured: -inf for -3e-39, eager -3.3e38).

Declines: an exponent that is not an integer, or an integer outside {3, 4} (2 is
left to upstream, which delegates it as XNNPACK's square); an input dtype XNNPACK
does not compile the multiplies in; a quantized input.
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
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import call_on_values, node_value

FOLD = "xnnpack.pow_of_small_integer_as_multiplies"

aten = torch.ops.aten
EXPONENTS = (3, 4)
UPSTREAM_EXPONENTS = (2,)  # upstream's PowConfig runs these as XNNPACK's square


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


def not_negative(exponent: int) -> Declined | None:
    if exponent < 0:
        return Declined(
            f"exponent {exponent}: 1 / x would run on XNNPACK, which flushes a subnormal x "
            "to zero (an infinite result where eager's is finite)"
        )
    return None


def within_bound(exponent: int) -> Declined | None:
    if exponent not in EXPONENTS:
        shown = ", ".join(map(str, EXPONENTS))
        return Declined(f"exponent {exponent}: only {shown} are written as multiplies")
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
        lambda: not_negative(exponent),
        lambda: within_bound(exponent),
        lambda: dtype_taken(value, dtypes, "power"),
        lambda: not_quantized(source, "the multiplies would each need quantization"),
    )
    return declined if declined is not None else PowAsMultiplies(node, exponent)


def _insert(anchor: torch.fx.Node, target, *args) -> torch.fx.Node:
    """`target(*args)` before `anchor`, with `anchor`'s metadata and its own value."""
    with anchor.graph.inserting_before(anchor):
        return call_on_values(anchor.graph, target, args, meta=anchor.meta)


def rewrite_as_multiplies(match: PowAsMultiplies) -> None:
    node, x = match.node, match.node.args[0]
    square = _insert(node, aten.mul.Tensor, x, x)
    other = x if match.exponent == 3 else square
    power = _insert(node, aten.mul.Tensor, square, other)
    node.replace_all_uses_with(power)
    node.graph.erase_node(node)
    record_applied(FOLD, node.name, f"x ** {match.exponent} as multiplies")


def pows_of_small_integers_as_multiplies(
    program: ExportedProgram, *, bf16: bool
) -> ExportedProgram:
    """`program`, or a rewritten copy where some power of a small integer is multiplies.

    `bf16`: whether XNNPACK compiles these multiplies in bf16 here."""
    match = functools.partial(match_pow, dtypes=delegated_floats(bf16))
    return rewrite_matches_on_a_copy(program, match, rewrite_as_multiplies, FOLD)
