# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Attention drops a boolean mask that keeps every score, at every size.

Given:   o = sdpa(q, k, v, attn_mask=m)     m boolean, True everywhere at every size
Result:  o = sdpa(q, k, v)

A boolean mask keeps the scores where it is True and sends the others to -inf. A
mask True everywhere keeps them all: SDPA's scores, softmax and output are those of
no mask (its decomposition adds where(m, 0, -inf), which changes at most a -0.0
score into +0.0: the same exponential).

Why: a mask True at every length is built at runtime from the length, on integer and
boolean ops XNNPACK does not take, and turned into a float mask per layer outside the
delegates: transformers' `sdpa_mask` for an encoder called without a padding mask (a
wav2vec2 on raw audio) builds `arange(s) >= 0` expanded to [1, 1, s, s]; a user's
`ones(s, s, dtype=bool)`, `ones_like(..)` or `new_ones(..)` say the same.

Declines: a mask not known when lowering at every size (it reads a user input's
values, or its sizes are too many to check), or one that is False somewhere (named
with the size). Runs on the ATen program, before decomposition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from etfold.backends.xnnpack._passes.attention_mask_unexpanded_pass import MASK_AT, SDPA
from etfold.backends.xnnpack._passes.mask_at_every_size import (
    elements_source,
    known_at_every_size,
)
from etfold.decisions import Declined, record_applied
from etfold.exir.passes.graph_walk import StateFacts, drop_unread, state_facts
from etfold.exir.passes.node_rewrite_driver import rewrite_judged_on_a_copy
from etfold.exir.passes.node_shapes import node_value

FOLD = "xnnpack.attention_mask_all_true"


@dataclass(frozen=True)
class MaskAllTrue:
    attention: Node
    mask: Node
    sizes: int  # the size assignments checked (1: a mask of static shape)


def _bool_mask(node: Node) -> Node | None:
    mask = node.args[MASK_AT] if len(node.args) > MASK_AT else node.kwargs.get("attn_mask")
    value = node_value(mask)
    return mask if value is not None and value.dtype is torch.bool else None


def judge_mask_all_true(
    node: Node, program: ExportedProgram, facts: StateFacts
) -> int | Declined | None:
    """How many sizes `node`'s boolean mask was checked True everywhere at, why it is
    kept, or None when `node` is no attention with a boolean mask."""
    if node.op != "call_function" or node.target is not SDPA:
        return None
    mask = _bool_mask(node)
    if mask is None:
        return None
    values = known_at_every_size(program, elements_source(mask), facts)
    if isinstance(values, Declined):
        return values
    for assignment, value in values:
        if not bool(value.all()):
            at = (
                f" at {', '.join(f'{k} = {v}' for k, v in assignment.items())}"
                if assignment
                else ""
            )
            return Declined(f"the mask `{mask.name}` is False somewhere{at}: it masks scores")
    return len(values)


def match_mask_all_true(node: Node, sizes: int) -> MaskAllTrue:
    return MaskAllTrue(node, _bool_mask(node), sizes)


def rewrite_mask_all_true(match: MaskAllTrue) -> None:
    attention = match.attention
    if len(attention.args) > MASK_AT:
        attention.update_arg(MASK_AT, None)
    else:
        attention.update_kwarg("attn_mask", None)
    drop_unread([match.mask])
    record_applied(
        FOLD,
        attention.name,
        f"the mask `{match.mask.name}` is True everywhere at each of its {match.sizes} sizes",
    )


def attention_masks_all_true_dropped(program: ExportedProgram) -> ExportedProgram:
    """`program`, or a rewritten copy where some attention drops a mask that keeps every
    score at every size."""
    facts = state_facts(program)

    def judge(node: Node) -> int | Declined | None:
        return judge_mask_all_true(node, program, facts)

    return rewrite_judged_on_a_copy(
        program, judge, match_mask_all_true, rewrite_mask_all_true, FOLD
    )
