# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Attention's `is_causal` as the boolean mask it stands for.

Given:   o = sdpa(q, k, v, is_causal=True)          q: [.., L, E], k: [.., S, E]
Result:  o = sdpa(q, k, v, attn_mask=tril(ones(L, S, bool)))

`is_causal=True` is defined as that mask (`torch.nn.functional.
scaled_dot_product_attention`: `ones(L, S, dtype=bool).tril(diagonal=0)`), and
torch's math decomposition builds exactly it before converting it to the float mask
it adds: both forms compute the same ops on the same values, bit for bit. L and S
are read as sizes of q and k (`sym_size` where they are symbolic).

Why: inside the attention the mask is out of reach of the passes that deal with
masks, and the decomposition builds it on every call from `arange`, `le`,
`logical_and`, `where` and `scalar_tensor`, none of which XNNPACK runs: 10 ops
outside the delegate per attention, static or dynamic. As an explicit mask it is
what a user's `tril` mask is: folded to a constant on a static export, a table's
slice on a dynamic one, and its fully-masked-row guard dropped (no row of a lower
triangle is empty).

Declines: an attention with dropout (a mask is only defined with `dropout_p == 0`
here: dropout draws per call). Runs on the ATen program, before decomposition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._guards import detect_fake_mode
from torch.export import ExportedProgram
from torch.fx import Node

from etfold.backends.xnnpack._passes.attention_mask_unexpanded_pass import MASK_AT, SDPA
from etfold.decisions import Declined, record_applied
from etfold.exir.passes.graph_walk import call_with_value
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import node_value

FOLD = "xnnpack.causal_attention_as_mask"

aten = torch.ops.aten
DROPOUT_AT, CAUSAL_AT = 4, 5  # dropout_p's and is_causal's positions among SDPA's arguments


@dataclass(frozen=True)
class CausalAttention:
    attention: Node


def _argument(node: Node, position: int, name: str, default: object) -> object:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def no_dropout(node: Node) -> Declined | None:
    dropout = _argument(node, DROPOUT_AT, "dropout_p", 0.0)
    if dropout != 0:
        return Declined(f"dropout_p={dropout}: the attention draws a mask per call")
    return None


def match_causal_attention(node: Node) -> CausalAttention | Declined | None:
    """The rewrite of a causal attention, why it stays, or None for any other node."""
    if node.op != "call_function" or node.target is not SDPA:
        return None
    if _argument(node, CAUSAL_AT, "is_causal", False) is not True:
        return None
    if (declined := no_dropout(node)) is not None:
        return declined
    return CausalAttention(node)


def _size(graph, tensor: Node, dim: int) -> object:
    """`tensor`'s size along `dim`: an int, or a `sym_size` node reading it."""
    size = node_value(tensor).shape[dim]
    if type(size) is int:
        return size
    read = graph.call_function(aten.sym_size.int, (tensor, dim))
    read.meta["val"] = size
    return read


def rewrite_causal_attention(match: CausalAttention) -> None:
    attention = match.attention
    graph = attention.graph
    query, key = attention.args[0], attention.args[1]
    with graph.inserting_before(attention):
        rows = _size(graph, query, node_value(query).dim() - 2)
        columns = _size(graph, key, node_value(key).dim() - 2)
        sizes = [rows, columns]
        shape = [node_value(s) if isinstance(s, Node) else s for s in sizes]
        with detect_fake_mode([node_value(query)]):
            ones = torch.ones(shape, dtype=torch.bool)
            lower = torch.tril(ones)
        ones_node = call_with_value(
            graph, aten.ones.default, (sizes,), ones, kwargs={"dtype": torch.bool}
        )
        mask = call_with_value(graph, aten.tril.default, (ones_node,), lower)
    args = list(attention.args) + [None] * max(0, CAUSAL_AT + 1 - len(attention.args))
    args[MASK_AT], args[DROPOUT_AT] = mask, _argument(attention, DROPOUT_AT, "dropout_p", 0.0)
    args[CAUSAL_AT] = False
    attention.args = tuple(args)
    attention.kwargs = {
        k: v
        for k, v in attention.kwargs.items()
        if k not in ("attn_mask", "dropout_p", "is_causal")
    }
    record_applied(FOLD, attention.name, "is_causal as tril(ones(L, S)), its boolean mask")


def causal_attentions_as_masks(program: ExportedProgram) -> ExportedProgram:
    """`program`, or a rewritten copy where each causal attention reads its mask."""
    return rewrite_matches_on_a_copy(
        program, match_causal_attention, rewrite_causal_attention, FOLD
    )
