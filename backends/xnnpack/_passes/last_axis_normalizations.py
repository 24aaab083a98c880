# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The ops whose kernels normalize along the innermost axis in memory.

Softmax, log-softmax and layer norm each reduce along one axis and index their
input as if it were contiguous: XNNPACK's softmax inside a delegate, and
ExecuTorch's portable kernels outside one. Fed channels-last data, they
normalize over C where the program says W. Both layout guards ask this one set,
the delegate's (`last_axis_ops_read_nchw`) and the portable kernels'
(`contiguous_last_axis_inputs_pass`), in ATen and Edge form alike.
"""

from __future__ import annotations

import torch
from executorch.exir.dialects._ops import ops as exir_ops

from etfold.exir.passes.graph_walk import underlying_op

aten = torch.ops.aten

# ATen overloads: the functional forms export writes, and what they decompose to
LAST_AXIS_NORMALIZATIONS = frozenset(
    {
        aten.softmax.int,
        aten._softmax.default,
        aten.log_softmax.int,
        aten._log_softmax.default,
        aten.layer_norm.default,
        aten.native_layer_norm.default,
    }
)


def normalizes_along_memory_axis(node: torch.fx.Node) -> bool:
    """`node` is one of LAST_AXIS_NORMALIZATIONS, as an ATen or an Edge op."""
    return node.op == "call_function" and underlying_op(node.target) in LAST_AXIS_NORMALIZATIONS


def edge_forms() -> frozenset:
    """The set as Edge ops (upstream's layout pass keeps Edge ops in its sets)."""
    return frozenset(
        getattr(getattr(exir_ops.edge.aten, op._opname), op._overloadname)
        for op in LAST_AXIS_NORMALIZATIONS
    )
