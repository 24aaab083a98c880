# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Op families the Arm passes look through, and what each passes on unchanged.

A fold reaches past ops that compute nothing at inference (clone, alias,
detach, dropout in eval) and asks which ops keep their input's rounding
(layout ops, those no-ops, relu-like clamps, a functional `copy`). Each family
is a set of ATen overloads, matched for an Edge op through the overload it
wraps (`graph_walk.underlying_op`), so every pass asks the same sets.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from etfold.backends.arm._passes.layout_axes import is_layout
from etfold.exir.passes.graph_walk import underlying_op

_aten = torch.ops.aten
IDENTITY_OPS = frozenset(
    {_aten.clone.default, _aten.alias.default, _aten.detach.default, _aten.alias_copy.default}
)
COPY_OPS = frozenset({_aten.copy.default, _aten.copy_.default})
DROPOUT_OPS = frozenset({_aten.dropout.default, _aten.feature_dropout.default})
# clamps the Arm quantizer annotates with their producer's quantization
CLAMP_OPS = frozenset(
    {
        _aten.relu.default,
        _aten.relu_.default,
        _aten.relu6.default,
        _aten.hardtanh.default,
        _aten.clamp.default,
        _aten.clamp.Tensor,
    }
)


def _calls(node: Node, ops: frozenset) -> bool:
    """`node` calls one of `ops` (ATen overloads), as an ATen or an Edge dialect operator."""
    return node.op == "call_function" and underlying_op(node.target) in ops


def is_inference_noop(node: Node) -> bool:
    """Identity at inference: clone/alias/detach, and dropout in eval or with p = 0."""
    if node.op != "call_function":
        return False
    if _calls(node, IDENTITY_OPS):
        return True
    if _calls(node, DROPOUT_OPS):
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return train is False or p == 0
    return False


def keeps_input_quantization(node: Node) -> bool:
    """Layout ops, inference no-ops and relu-like clamps: the output is rounded as the input is."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
        return False
    return is_layout(node) or is_inference_noop(node) or _calls(node, CLAMP_OPS)


def quantization_source(node: Node) -> Node | None:
    """The node whose values (and rounding) `node` passes on unchanged, if any:
    the input of a layout op, no-op or clamp; the source of a functional `copy`."""
    if node.op == "call_function" and _calls(node, COPY_OPS) and len(node.args) > 1:
        source = node.args[1]
        return source if isinstance(source, Node) else None
    return node.args[0] if keeps_input_quantization(node) else None
