# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A padding mask expanded to [1, 1, t, t] before attention (transformers' sdpa_mask) is
read unexpanded: SDPA broadcasts it, so only its [1, 1, 1, t] float form is computed
outside the delegate, and on a dynamic sequence no squeeze of a t x t mask is."""

from __future__ import annotations

import functools
from collections import Counter

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack._passes.attention_mask_unexpanded_pass import (
    FOLD,
    attention_masks_unexpanded,
    broadcasts_to,
)
from etfold.decisions import collect_decisions
from etfold.harness.dynamic_pairs import (
    assert_dynamic_matches_eager,
    decisions_apart,
    lower_xnnpack_pair,
)
from etfold.harness.sequence_models import PADDED_LENGTH, WIDTH, padded_inputs


class ExpandedMaskAttention(torch.nn.Module):
    """Two attention layers reading one [1, t] padding mask, expanded to [1, 1, t, t]."""

    def __init__(self, width: int = WIDTH, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, 3 * width) for _ in range(2))

    def forward(self, x, keep):
        b, t, d = x.shape
        mask = keep.bool()[:, None, None, :].expand(b, -1, t, t)
        for qkv in self.layers:
            q, k, v = qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x.transpose(1, 2).reshape(b, t, d)
        return x


@functools.cache
def _pair():
    return lower_xnnpack_pair(ExpandedMaskAttention, padded_inputs, PADDED_LENGTH)


def test_each_attention_reads_the_mask_unexpanded_static_and_dynamic_alike():
    pair = _pair()
    for lowered in (pair.static, pair.dynamic):
        applied = [d for d in lowered.decisions if d.fold == FOLD]
        assert [d.applied for d in applied] == [True, True], applied
    static_only, dynamic_only = decisions_apart(pair, lambda fold: fold == FOLD)
    assert not static_only and not dynamic_only
    # no t x t mask outside: neither its expand nor, on the dynamic sequence, its squeeze
    outside = pair.dynamic.program.ops_outside()
    assert not {"aten.expand_copy.default", "aten.squeeze_copy.dims"} & set(outside), outside
    assert pair.dynamic.program.delegates() <= pair.static.program.delegates()
    assert_dynamic_matches_eager(pair)


def test_the_graph_drops_the_expand():
    program = torch.export.export(
        ExpandedMaskAttention().eval(),
        padded_inputs(6),
        dynamic_shapes=PADDED_LENGTH.dynamic_shapes(),
    )
    with collect_decisions() as decisions:
        rewritten = attention_masks_unexpanded(program)
    ops = Counter(str(n.target) for n in rewritten.graph.nodes if n.op == "call_function")
    assert ops["aten.expand.default"] == 0 and ops["aten.scaled_dot_product_attention.default"] == 2
    assert [d.applied for d in decisions if d.fold == FOLD] == [True, True]
    assert "aten.expand.default" in str(program.graph)  # the user's program keeps it
    inputs = padded_inputs(11)
    assert torch.equal(rewritten.module()(*inputs), program.module()(*inputs))


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(
    target=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    ones=st.lists(st.booleans(), max_size=4),
    drop=st.integers(0, 3),
)
def test_broadcasts_to_is_torchs_broadcast(target, ones, drop):
    shape = [
        1 if one else size
        for size, one in zip(target, (ones + [False] * 4)[: len(target)], strict=True)
    ][drop:]
    expected = torch.broadcast_shapes(tuple(shape), tuple(target)) == tuple(target)
    assert broadcasts_to(shape, target) == expected
    assert not broadcasts_to([*target, 1], target)  # more dims than the scores
    if any(size > 1 for size in target):
        assert not broadcasts_to([size + 1 for size in target], target)
