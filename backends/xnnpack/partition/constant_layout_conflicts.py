# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""One constant, one serialized form per delegate.

    delegate{ conv(x, W), mul(W, s) }        W a constant placeholder
      -> delegate{ conv(x, W) }, mul(W, s)    mul keeps W's plain layout, outside

XNNPACK serializes a constant once per delegate, in the form its first reader
asks for: a convolution stores its weight NHWC (in/out swapped for depthwise and
transposed convs) and its weight and bias as fp32, and a bf16 linear stores its
bias as fp32. Every later reader in the same delegate gets that same value id,
so an elementwise op that reads a conv weight sees permuted data, or the conv
sees a plain one: a wrong program, with no error. Readers of one constant that
need different forms must not share a delegate; the readers whose form differs
from the first GEMM's are kept out of the partition. A conv1d weight serves one
conv only: XNNPACK unsqueezes it to 4-D in place for the first conv1d that
reads it, and a second conv1d would then read a 4-D weight with a 3-D input.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from executorch.exir.dialects._ops import ops as exir_ops
from torch.export import ExportedProgram

from etfold.exir.passes.graph_walk import state_placeholders
from etfold.exir.passes.node_shapes import node_value

_CONVOLUTION = exir_ops.edge.aten.convolution.default
_LINEAR = exir_ops.edge.aten.linear.default
_DEQUANTIZE_TARGETS = {
    exir_ops.edge.quantized_decomposed.dequantize_per_tensor.default,
    exir_ops.edge.quantized_decomposed.dequantize_per_channel.default,
}
PLAIN = "plain"


@dataclass(frozen=True)
class LayoutConflict:
    """Readers of one constant in one partition that XNNPACK would serialize differently."""

    constant: torch.fx.Node
    form: str  # the form the first GEMM reader asks for, which the partition keeps
    kept_out: tuple[torch.fx.Node, ...]

    @property
    def reason(self) -> str:
        names = ", ".join(n.name for n in self.kept_out)
        return (
            f"`{self.constant.name}` is serialized {self.form} for a GEMM in this delegate; "
            f"{names} read it in another form, so they stay outside it"
        )


def _dtype(node: torch.fx.Node) -> torch.dtype | None:
    value = node_value(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def _as_fp32(node: torch.fx.Node, form: str) -> str:
    return form if _dtype(node) in (None, torch.float32) else f"{form}, as fp32"


def serialized_form(reader: torch.fx.Node, value: torch.fx.Node) -> str:
    """How XNNPACK stores `value` when `reader` defines it first."""
    args = reader.args
    if reader.target == _CONVOLUTION and len(args) > 8:
        if args[1] is value:
            transposed = bool(args[6])
            depthwise = not transposed and node_value(value).shape[1] == 1
            if transposed:
                swap = f" with in/out swapped over {int(args[8])} groups"
            else:
                swap = " with in/out swapped" if depthwise else ""
            if node_value(value).dim() == 3:  # unsqueezed in place to 4-D for this conv alone
                swap += f", unsqueezed to 2-D for `{reader.name}`"
            return _as_fp32(value, f"as an NHWC conv weight{swap}")
        if len(args) > 2 and args[2] is value:
            return _as_fp32(value, PLAIN)
    bf16_linear_bias = reader.target == _LINEAR and len(args) > 2 and args[2] is value
    if bf16_linear_bias and _dtype(args[1]) == torch.bfloat16:
        return _as_fp32(value, PLAIN)
    return PLAIN


def _is_gemm_slot(reader: torch.fx.Node, value: torch.fx.Node) -> bool:
    return reader.target in (_CONVOLUTION, _LINEAR) and value in reader.args[1:3]


def _readers(value: torch.fx.Node) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(reader, the node it reads): direct readers, and readers through a dequantize."""
    found = []
    for user in value.users:
        if user.target in _DEQUANTIZE_TARGETS:
            found += [(reader, user) for reader in user.users]
        else:
            found.append((user, value))
    return found


def _conflict_in(constant: torch.fx.Node, members: set[torch.fx.Node]) -> LayoutConflict | None:
    readers = [(r, v) for r, v in _readers(constant) if r in members]
    gemms = [(r, v) for r, v in readers if _is_gemm_slot(r, v)]
    if not gemms:
        return None
    form = serialized_form(*gemms[0])
    out = tuple(r for r, v in readers if serialized_form(r, v) != form)
    return LayoutConflict(constant, form, out) if out else None


def find_layout_conflicts(
    program: ExportedProgram, partitions: Iterable[Iterable[torch.fx.Node]]
) -> list[LayoutConflict]:
    """Constants whose readers in one partition need different serialized forms."""
    state = set(state_placeholders(program).values())
    constants = [n for n in program.graph.find_nodes(op="placeholder") if n in state]
    conflicts = []
    for partition in partitions:
        members = set(partition)
        for constant in constants:
            conflict = _conflict_in(constant, members)
            if conflict is not None:
                conflicts.append(conflict)
    return conflicts
