# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Attention on a dynamic sequence is one delegate: its scores keep the bmm's shape
between the two matmuls, so no view holds the sequence size twice."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.attention_scores_in_bmm_shape_pass import (
    FOLD,
    attention_scores_in_bmm_shape,
)
from etfold.decisions import collect_decisions
from etfold.harness.dynamic_pairs import (
    LengthAxis,
    decisions_apart,
    dynamic_errors,
    lower_static_and_dynamic,
)

VIEW = "aten.view_copy.default"


class Attention(torch.nn.Module):
    def __init__(self, width: int = 16, heads: int = 2, causal: bool = False, mask=None):
        super().__init__()
        self.heads, self.causal, self.mask = heads, causal, mask
        self.qkv, self.o = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x):
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = None if self.mask is None else self.mask(t)
        y = F.scaled_dot_product_attention(*qkv, attn_mask=mask, is_causal=self.causal)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


def _sequence(length: int) -> tuple[torch.Tensor]:
    return (torch.randn(1, length, 16, generator=torch.Generator().manual_seed(length)),)


def _additive_mask(length: int) -> torch.Tensor:
    """A [1, 1, t, t] float mask from the length: each query sees itself and before."""
    keys = torch.arange(length)
    hidden = keys[None, :] > keys[:, None]
    return torch.where(hidden, float("-inf"), 0.0)[None, None]


# is_causal's mask is the 4-d mask's form (an additive [t, t] mask from the length between
# the bmm and the softmax) built by SDPA's decomposition: in `make test-long`
@pytest.mark.parametrize(
    "module",
    [
        pytest.param(Attention(), id="no-mask"),
        pytest.param(Attention(causal=True), id="causal", marks=pytest.mark.long),
        pytest.param(Attention(mask=_additive_mask), id="4-d-mask"),
    ],
)
def test_dynamic_attention_is_one_delegate_like_the_static_one(module):
    torch.manual_seed(0)
    axis = LengthAxis(((1,),), 2, 16, 6)
    pair = lower_static_and_dynamic(module, _sequence, axis, lambda: [XnnpackPartitioner()])
    assert [d.applied for d in pair.dynamic.decisions if d.fold == FOLD] == [True]
    # the static views are XNNPACK's: nothing to rewrite there, so no decision
    static_only, dynamic_only = decisions_apart(pair, lambda fold: fold == FOLD)
    assert not static_only and dynamic_only == Counter({(FOLD, True, ""): 1})
    assert pair.dynamic.program.delegates() == pair.static.program.delegates() == 1
    assert VIEW not in pair.dynamic.program.ops_outside()
    errors = dynamic_errors(pair)
    assert {axis.low, axis.high} <= set(errors) and max(errors.values()) <= 1e-5, errors


def _two_sequences(length: int) -> tuple[torch.Tensor]:
    return (torch.randn(2, length, 16, generator=torch.Generator().manual_seed(length)),)


# `make test` holds a batch of two through test_attention_masks_as_whole_delegates
@pytest.mark.long
def test_a_batch_of_two_keeps_the_bmm_shape_too():
    """Scores [2, H, t, t] are the bmm's [2H, t, t]: the leading dim splits in two, and
    a mask broadcast over batch and heads reads the same for each matrix."""
    torch.manual_seed(0)
    axis = LengthAxis(((1,),), 2, 16, 6)
    pair = lower_static_and_dynamic(
        Attention(mask=_additive_mask), _two_sequences, axis, lambda: [XnnpackPartitioner()]
    )
    assert [d.applied for d in pair.dynamic.decisions if d.fold == FOLD] == [True]
    assert pair.dynamic.program.delegates() == pair.static.program.delegates() == 1
    assert VIEW not in pair.dynamic.program.ops_outside()
    errors = dynamic_errors(pair)
    assert {axis.low, axis.high} <= set(errors) and max(errors.values()) <= 1e-5, errors


def test_a_static_program_keeps_its_views():
    program = torch.export.export(Attention().eval(), _sequence(5))
    table = XnnpackPartitioner()._decomposition_table(program)
    code = program.graph_module.code
    with collect_decisions() as decisions:
        assert attention_scores_in_bmm_shape(program, table) is program
    assert program.graph_module.code == code
    assert [d for d in decisions if d.fold == FOLD] == []


class PaddedAttention(Attention):
    """Attention under a [1, t] padding mask from the user: SDPA keeps its safe-softmax
    guard, since every key of a row may be hidden."""

    def forward(self, x, keep):
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(*qkv, attn_mask=keep[:, None, None, :])
        return self.o(y.transpose(1, 2).reshape(b, t, d))


def _padded_sequence(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    keep = torch.ones(1, length, dtype=torch.bool)
    keep[0, length - length // 3 :] = False
    return _sequence(length)[0], keep


def test_the_safe_softmax_guard_keeps_the_bmm_shape_too():
    torch.manual_seed(0)
    axis = LengthAxis(((1,), (1,)), 2, 16, 6)
    pair = lower_static_and_dynamic(
        PaddedAttention(), _padded_sequence, axis, lambda: [XnnpackPartitioner()]
    )
    (applied,) = [d for d in pair.dynamic.decisions if d.fold == FOLD]
    # the add, the softmax, the guard (its rows read from the mask: a multiply) and the
    # same-shape expand before the second bmm
    assert applied.applied and applied.detail.startswith("4 ops"), applied.detail
    static_only, dynamic_only = decisions_apart(pair, lambda fold: fold == FOLD)
    assert not static_only and dynamic_only == Counter({(FOLD, True, ""): 1})
    # the row test stays outside (on the mask), in both; no view does
    assert pair.dynamic.program.delegates() <= pair.static.program.delegates()
    assert VIEW not in pair.dynamic.program.ops_outside()
    errors = dynamic_errors(pair)
    assert {axis.low, axis.high} <= set(errors) and max(errors.values()) <= 1e-5, errors


class Scores(torch.nn.Module):
    """bmm, a view to [1, H, t, t], `between`, a view back, bmm: SDPA's shape, by hand."""

    def __init__(self, between):
        super().__init__()
        self.between = between

    def forward(self, q, k, v, mask):
        heads, t, _ = q.shape
        scores = torch.bmm(q, k).view(1, heads, t, t)
        out = self.between(scores, mask)
        if isinstance(out, tuple):  # a second reader of the scores, added to the result
            out, extra = out
            return torch.bmm(out.reshape(heads, t, t), v) + extra
        return torch.bmm(out.reshape(heads, t, t), v)


def _softmax(s):
    return torch.ops.aten._softmax(s, -1, False)  # the op SDPA's decomposition writes


def _second_view(s, mask):
    return _softmax(s), s.reshape(s.shape[1:])[..., :1]


BETWEEN = {
    "not an elementwise op": (lambda s, mask: _softmax(s.relu()), "mask4"),
    "views, not one view back": (_second_view, "mask4"),
    "not 4-D with the leading": (lambda s, mask: _softmax(s + mask), "mask5"),
    "from outside f, not as a mask": (lambda s, mask: _softmax(mask * s), "mask4"),
    "not as a mask broadcast over B and H": (lambda s, mask: _softmax(s + mask), "per-head"),
    "without a softmax": (lambda s, mask: s * 2.0, "mask4"),
}


@pytest.mark.parametrize("reason", BETWEEN)
def test_declines_when(reason):
    between, mask_kind = BETWEEN[reason]
    heads, t = 2, 5
    shapes = {"mask5": (1, 1, 1, 1, t), "per-head": (1, heads, 1, t), "mask4": (1, 1, 1, t)}
    mask = torch.zeros(shapes[mask_kind])
    inputs = (torch.randn(heads, t, 4), torch.randn(heads, 4, t), torch.randn(heads, t, 4), mask)
    length = torch.export.Dim("t", min=2, max=16)
    shapes = ({1: length}, {2: length}, {1: length}, {mask.dim() - 1: length})
    program = torch.export.export(Scores(between).eval(), inputs, dynamic_shapes=shapes)
    code = program.graph_module.code
    with collect_decisions() as decisions:
        assert attention_scores_in_bmm_shape(program, None) is program
    assert program.graph_module.code == code
    (declined,) = [d for d in decisions if d.fold == FOLD]
    assert not declined.applied and reason in declined.detail, declined.detail
