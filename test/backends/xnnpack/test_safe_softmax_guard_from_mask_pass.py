# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""With a mask read at runtime, SDPA's fully-masked-row guard reads its rows from the
mask and becomes a multiply: the same bits as the guard, fully masked rows included,
for boolean and additive masks of every shape that broadcasts over batch and heads."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.safe_softmax_guard_from_mask_pass import (
    FOLD,
    safe_softmax_guards_from_masks,
)
from etfold.decisions import collect_decisions

aten = torch.ops.aten
GUARD = {aten.eq.Scalar, aten.logical_not.default, aten.full_like.default}


class Attention(torch.nn.Module):
    """`layers` attentions in a row, each reading the one runtime mask."""

    def __init__(self, layers: int = 1):
        super().__init__()
        self.layers = layers

    def forward(self, q, k, v, mask):
        for _ in range(self.layers):
            q = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return q


MASK_SHAPES = {
    "TT": lambda b, t: (t, t),
    "1TT": lambda b, t: (1, t, t),
    "11TT": lambda b, t: (1, 1, t, t),
    "B1TT": lambda b, t: (b, 1, t, t),
    "B11T": lambda b, t: (b, 1, 1, t),
}


def _inputs(batch, length, form, additive, dtype=torch.float32, seed=0, hidden=0.3):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, 2, length, 4, generator=generator).to(dtype) for _ in range(3))
    keep = torch.rand(MASK_SHAPES[form](batch, length), generator=generator) > hidden
    # a fully masked row: the guard's zeros (a padding mask: the first sequence's every row)
    if keep.shape[-2] > 1:
        keep[..., 0, :] = False
    else:
        keep[0] = False
    mask = torch.where(keep, 0.0, float("-inf")).to(dtype) if additive else keep
    return q, k, v, mask


def _decomposed(program):
    table = XnnpackPartitioner()._decomposition_table(program)
    return program.run_decompositions(table), table


def _rewritten(program, table):
    with collect_decisions() as decisions:
        rewritten = safe_softmax_guards_from_masks(program, table)
    return rewritten, [(d.applied, d.detail) for d in decisions if d.fold == FOLD]


def _targets(program) -> Counter:
    return Counter(n.target for n in program.graph.nodes if n.op == "call_function")


def test_the_guard_is_a_multiply_and_the_row_test_runs_once_per_mask():
    """Two layers read one additive mask: one row test. (A boolean mask is converted to
    its additive form by each layer's decomposition: one row test per conversion.)"""
    inputs = _inputs(1, 5, "11TT", additive=True)
    program = torch.export.export(Attention(layers=2), inputs)
    table = XnnpackPartitioner()._decomposition_table(program)
    rewritten, decisions = _rewritten(program, table)
    assert [applied for applied, _ in decisions] == [True, True]
    targets = _targets(rewritten)
    assert not GUARD & set(targets)
    # one row test for both layers; each layer's softmax times the rows kept
    assert targets[aten.ne.Scalar] == targets[aten.any.dim] == 1
    assert targets[aten.mul.Tensor] >= 2
    assert set(_targets(_decomposed(program)[0])) >= GUARD  # the user's program keeps its own


@settings(max_examples=3)
@given(
    batch=st.integers(1, 3),
    length=st.integers(1, 7),
    form=st.sampled_from(sorted(MASK_SHAPES)),
    additive=st.booleans(),
    half=st.booleans(),
    hidden=st.sampled_from([0.0, 0.3, 0.9]),
    seed=st.integers(0, 2**16),
)
def test_the_rewritten_guard_computes_the_same_bits(
    batch, length, form, additive, half, hidden, seed
):
    dtype = torch.float16 if half else torch.float32
    inputs = _inputs(batch, length, form, additive, dtype, seed, hidden)
    program = torch.export.export(Attention(), inputs)
    decomposed, table = _decomposed(program)
    rewritten, decisions = _rewritten(program, table)
    assert [applied for applied, _ in decisions] == [True]
    expected = decomposed.module()(*inputs)
    torch.testing.assert_close(rewritten.module()(*inputs), expected, atol=0, rtol=0)


class Scores(torch.nn.Module):
    """bmm, plus a mask, SDPA's guarded softmax (`_safe_softmax`), `after` it."""

    def __init__(self, after=None, mask_of=None):
        super().__init__()
        self.after, self.mask_of = after, mask_of

    def forward(self, q, k, mask):
        mask = self.mask_of(mask) if self.mask_of else mask
        x = torch.bmm(q, k) + mask
        y = aten._safe_softmax.default(x, -1)
        return self.after(x, y) if self.after else torch.bmm(y, q)


DECLINES = {
    "no floating-point tensor": Scores(mask_of=lambda m: (m > 0).int()),
    "are read by": Scores(after=lambda x, y: torch.bmm(y, x)),
    "the program returns the guarded softmax": Scores(after=lambda x, y: y),
}


@pytest.mark.parametrize("reason", DECLINES)
def test_declines_when(reason):
    inputs = (torch.randn(2, 5, 5), torch.randn(2, 5, 5), torch.randn(1, 5, 5))
    program = torch.export.export(DECLINES[reason].eval(), inputs)
    decomposed, table = _decomposed(program)
    code = decomposed.graph_module.code
    rewritten, decisions = _rewritten(decomposed, table)
    assert rewritten is decomposed and decomposed.graph_module.code == code
    ((applied, detail),) = decisions
    assert not applied and reason in detail, detail
