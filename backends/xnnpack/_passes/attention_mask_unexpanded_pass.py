# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Attention reads its mask unexpanded: SDPA broadcasts it anyway.

Given:   o = sdpa(q, k, v, attn_mask=expand(m, S))     m, S broadcast to the scores'
                                                       shape T = [.., L, S_k]
Result:  o = sdpa(q, k, v, attn_mask=m)

SDPA adds (or, for a boolean mask, selects by) its mask broadcast to T. expand(m, S)
is m broadcast to S, and broadcasting composes: each dim of m is 1 or S's, each of
S's is 1 or T's, so m broadcast to T is expand(m, S) broadcast to T, element for
element.

Why: transformers' masks (`sdpa_mask`) expand the [b, 1, 1, s] padding mask to [b, 1,
s, s] before attention. XNNPACK has no boolean tensors, so that expand stays outside
the delegates, and SDPA's decomposition turns the s x s booleans into an s x s float
mask per layer, which on a dynamic sequence (two symbolic sizes) also needs a squeeze
outside to reach the scores' bmm shape. Unexpanded, the float mask is [b, 1, 1, s],
and its squeeze a view XNNPACK takes: the add broadcasts it inside the delegate.

Declines: m not known to broadcast to the scores' shape (a size that neither is 1
nor equals the scores'). Runs on the ATen program, before decomposition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from etfold.decisions import Declined, record_applied
from etfold.exir.passes.graph_walk import drop_unread, sizes_known_equal
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import node_value

FOLD = "xnnpack.attention_mask_unexpanded"

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
MASK_AT = 3  # attn_mask's position among SDPA's arguments


@dataclass(frozen=True)
class ExpandedMask:
    attention: Node
    expand: Node


def broadcasts_to(shape: Sequence, target: Sequence) -> bool:
    """Each dim of `shape`, aligned from the last, is 1 or known equal to `target`'s."""
    if len(shape) > len(target):
        return False
    aligned = target[len(target) - len(shape) :]
    return all(
        sizes_known_equal(size, 1) or sizes_known_equal(size, want)
        for size, want in zip(shape, aligned, strict=True)
    )


def _mask(node: Node) -> object:
    if len(node.args) > MASK_AT:
        return node.args[MASK_AT]
    return node.kwargs.get("attn_mask")


def _scores_shape(node: Node) -> list:
    query, key = node_value(node.args[0]), node_value(node.args[1])
    return [*query.shape[:-1], key.shape[-2]]


def match_expanded_mask(node: Node) -> ExpandedMask | Declined | None:
    if node.op != "call_function" or node.target is not SDPA:
        return None
    mask = _mask(node)
    if not isinstance(mask, Node) or mask.target is not aten.expand.default:
        return None
    source = node_value(mask.args[0])
    if source is None or not broadcasts_to(list(source.shape), _scores_shape(node)):
        return Declined(
            f"`{mask.args[0].name}` ({list(getattr(source, 'shape', []))}) is not known "
            f"to broadcast to the scores' {_scores_shape(node)}"
        )
    return ExpandedMask(node, mask)


def rewrite_expanded_mask(match: ExpandedMask) -> None:
    attention, expand, source = match.attention, match.expand, match.expand.args[0]
    attention.replace_input_with(expand, source)
    drop_unread([expand])
    record_applied(FOLD, attention.name, f"reads `{source.name}`, not its expand")


def attention_masks_unexpanded(program: ExportedProgram) -> ExportedProgram:
    """`program`, or a rewritten copy where some attention reads its mask unexpanded."""
    return rewrite_matches_on_a_copy(program, match_expanded_mask, rewrite_expanded_mask, FOLD)
