# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Graph reading shared by the integer DyT folds (after q/dq folding, INT profile).

At that point a quantized elementwise op reads int32 operands produced by
`tosa.RESCALE`, and a constant operand is `RESCALE(int8 constant)`, possibly
behind a broadcasting `view_copy`. These helpers read such structure without
touching the graph; anything unexpected answers None and the caller declines.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from executorch.backends.arm._passes.arm_pass import ArmPass
from executorch.backends.arm._passes.quant_args import QuantArgs
from executorch.backends.arm.tosa.specification import (
    TosaLoweringContext,
    TosaSpecification,
    get_context_spec,
)
from executorch.exir import ExportedProgram
from executorch.exir.dialects._ops import ops as exir_ops
from executorch.exir.pass_base import PassResult
from torch.fx import GraphModule, Node

from etfold.backends.arm._passes.constants import constant_tensor, delete_constant_if_unused
from etfold.backends.arm._passes.fake_values import ensure_fake_values
from etfold.backends.arm._passes.tosa_integer import Rescale
from etfold.decisions import record_declined
from etfold.exir.passes.node_rewrite_driver import rewrite_each_match

RESCALE = exir_ops.backend.tosa.RESCALE.default
TABLE = exir_ops.backend.tosa.TABLE.default
MUL = exir_ops.edge.aten.mul.Tensor
ADD = exir_ops.edge.aten.add.Tensor
VIEW = exir_ops.edge.aten.view_copy.default
SLICE = exir_ops.edge.aten.slice_copy.Tensor
TANH = exir_ops.edge.aten.tanh.default


def rescale_of(node: object) -> Rescale | None:
    """The node's RESCALE if it is a plain per-tensor, signed one."""
    if not isinstance(node, Node) or node.op != "call_function" or node.target != RESCALE:
        return None
    if len(node.args) < 5 or not isinstance(node.args[0], Node):
        return None
    scales = node.args[2]
    if not isinstance(scales, (list, tuple)) or len(scales) != 1:
        return None
    if node.kwargs.get("input_unsigned", False) or node.kwargs.get("output_unsigned", False):
        return None
    if len(node.args) > 5 and any(node.args[5:]):
        return None
    return Rescale(float(scales[0]), int(node.args[3]), int(node.args[4]), node.args[1])


def constant_of(exported_program: ExportedProgram | None, node: object) -> torch.Tensor | None:
    """The tensor behind a constant placeholder (never a mutated buffer), else None."""
    if not isinstance(node, Node) or node.op != "placeholder":
        return None
    return constant_tensor(node, exported_program)


def single_qargs(node: Node, key: str) -> QuantArgs | None:
    """The node's only per-tensor qparams under `key` ("input_qparams"/"output_qparams")."""
    qparams = node.meta.get(key) or {}
    if len(qparams) != 1:
        return None
    qargs = next(iter(qparams.values()))
    if not isinstance(qargs, QuantArgs) or qargs.per_channel:
        return None
    return qargs


@dataclass(frozen=True)
class Int32Constant:
    """An int32 operand that is a constant: its values and the nodes that make it.

    `values` has the operand's own shape (after the view, if any); `nodes` are
    the view/RESCALE nodes and `source` the int8 constant placeholder.
    """

    values: torch.Tensor  # int64, exactly what TOSA computes for the operand
    source: Node
    nodes: tuple[Node, ...]


def int32_constant_operand(
    exported_program: ExportedProgram | None, operand: Node
) -> Int32Constant | None:
    """Read `[view_copy](RESCALE(int8 constant))` as the int32 values TOSA produces."""
    nodes: list[Node] = []
    view_shape = None
    node = operand
    if node.op == "call_function" and node.target == VIEW:
        view_shape = node.args[1]
        nodes.append(node)
        node = node.args[0]
        if not isinstance(node, Node):
            return None
    rescale = rescale_of(node)
    if rescale is None or rescale.output_dtype != torch.int32:
        return None
    source = node.args[0]
    codes = constant_of(exported_program, source)
    if codes is None or codes.dtype != torch.int8:
        return None
    values = rescale.apply(codes)
    if view_shape is not None:
        if not isinstance(view_shape, (list, tuple)) or not all(type(d) is int for d in view_shape):
            return None
        if values.numel() != math.prod(view_shape):
            return None
        values = values.reshape(view_shape)
    nodes.append(node)
    return Int32Constant(values, source, tuple(nodes))


def erase_unused(graph_module, exported_program: ExportedProgram, nodes) -> None:
    """Erase each of `nodes` (consumers first) that nothing reads any more.

    A constant placeholder also leaves the program's signature and state.
    """
    for node in nodes:
        if node.users:
            continue
        if node.op == "placeholder":
            delete_constant_if_unused(graph_module, exported_program, node)
        else:
            node.graph.erase_node(node)


@contextlib.contextmanager
def tosa_int_context() -> Iterator[None]:
    """The TOSA lowering context in force, or TOSA-1.0+INT when the pass runs standalone."""
    try:
        get_context_spec()
    except RuntimeError:
        with TosaLoweringContext(TosaSpecification.create_from_string("TOSA-1.0+INT")):
            yield
        return
    yield


class IntegerDyTFoldPass(ArmPass):
    """Drives an integer DyT fold: match every node, record each decision, rewrite
    each match, then retrace once so every rewired node's fake value carries the
    int8 codes it now holds. Subclasses give `FOLD`, `match` and `rewrite`.

    Runs standalone as well as inside ArmPassManager: outside a
    TosaLoweringContext it enters one for TOSA-1.0+INT (the TOSA ops' fake
    kernels need it), and nodes without meta["val"] get one by fake propagation
    first; if that fails, every site is declined with the reason.
    """

    FOLD: str

    def __init__(self, exported_program: ExportedProgram | None = None) -> None:
        super().__init__()
        # ArmPassManager's adapter sets this to the program being lowered.
        self.exported_program = exported_program

    def match(self, node: Node):
        """A match, a Declined, or None when `node` is not where this fold starts."""
        raise NotImplementedError

    def rewrite(self, graph_module: GraphModule, match) -> str:
        """Apply `match`; return the detail to record."""
        raise NotImplementedError

    def call(self, graph_module: GraphModule) -> PassResult:
        with tosa_int_context():
            if (declined := ensure_fake_values(graph_module)) is not None:
                record_declined(self.FOLD, graph_module.__class__.__name__, declined.reason)
                return PassResult(graph_module, False)
            return self._fold(graph_module)

    def _fold(self, graph_module: GraphModule) -> PassResult:
        nodes = list(graph_module.graph.nodes)
        rewrite = functools.partial(self.rewrite, graph_module)
        modified = rewrite_each_match(nodes, self.match, rewrite, self.FOLD)
        if modified:
            graph_module.graph.lint()
            graph_module.recompile()
            graph_module = super().call(graph_module).graph_module
        return PassResult(graph_module, modified)
