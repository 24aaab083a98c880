# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Attention as users write it around SDPA's mask: separate q, k, v projections, 4
heads, and the mask in each form they give it, for the tests of the mask rewrites.

Mask kinds (`MASKS`):
- "tril": `tril(ones(T, T, bool))`, computed from the length;
- "causal": `is_causal=True`;
- "buffer": a registered boolean lower triangle sliced to the length (`bias[.., :T, :T]`);
- "additive": a float `triu(full(T, T, -inf), 1)`; "finfo_min": the same with the
  dtype's lowest value;
- "additive_buffer": a registered float triangle, sliced;
- "input": a boolean mask the caller passes; "input_additive": a float one (0 / -inf).
Forms (`FORMS`): the mask's shape, [T, T], [1, T, T], [1, 1, T, T] or [B, 1, T, T]
(a computed mask expanded over the batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from etfold.harness.dynamic_pairs import LengthAxis

WIDTH, HEADS = 32, 4
MAX_LENGTH = 24  # the buffers' rows; a dynamic length stays below it
MASKS = (
    "tril",
    "causal",
    "buffer",
    "additive",
    "finfo_min",
    "additive_buffer",
    "input",
    "input_additive",
)
FORMS = ("TT", "1TT", "11TT", "B1TT")
INPUT_MASKS = ("input", "input_additive")


def mask_shape(form: str, batch: int, length: int) -> tuple[int, ...]:
    return {
        "TT": (length, length),
        "1TT": (1, length, length),
        "11TT": (1, 1, length, length),
        "B1TT": (batch, 1, length, length),
    }[form]


class MaskedAttention(torch.nn.Module):
    """x -> SDPA(q(x), k(x), v(x), mask) over 4 heads, the mask of `kind` in `form`."""

    def __init__(self, kind: str, form: str = "11TT"):
        super().__init__()
        self.kind, self.form = kind, form
        self.q, self.k, self.v = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))
        rows = MAX_LENGTH + 1
        lower = torch.ones(rows, rows, dtype=torch.bool).tril()
        self.register_buffer("bias", lower.view(1, 1, rows, rows))
        upper = torch.full((rows, rows), float("-inf")).triu(1)
        self.register_buffer("additive_bias", upper.view(1, 1, rows, rows))

    def _heads(self, x, projection):
        b, t, _ = x.shape
        return projection(x).view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2)

    def _mask(self, x, given):
        b, t, _ = x.shape
        if self.kind in INPUT_MASKS:
            return given
        if self.kind == "tril":
            mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
        elif self.kind == "additive":
            mask = torch.triu(torch.full((t, t), float("-inf"), dtype=x.dtype), 1)
        elif self.kind == "finfo_min":
            mask = torch.triu(torch.full((t, t), torch.finfo(x.dtype).min, dtype=x.dtype), 1)
        elif self.kind == "buffer":
            mask = self.bias[:, :, :t, :t]
        elif self.kind == "additive_buffer":
            mask = self.additive_bias[:, :, :t, :t].to(x.dtype)
        else:
            raise ValueError(self.kind)
        if self.form == "B1TT":
            return mask.reshape(1, 1, t, t).expand(b, 1, t, t)
        return mask.reshape(mask_shape(self.form, b, t))

    def forward(self, x, mask=None):
        q, k, v = (self._heads(x, p) for p in (self.q, self.k, self.v))
        if self.kind == "causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask(x, mask))


def masked_inputs(kind: str, form: str, batch: int, dtype=torch.float32):
    """`make_inputs(length)` for a pair: a sequence, and the mask when the caller gives
    it (a boolean one hiding about a third, or its additive form; the first row of
    each matrix hidden whole, so the guard's zeros are exercised), drawn from the
    length as seed."""

    def make(length: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(length)
        x = torch.randn(batch, length, WIDTH, generator=generator).to(dtype)
        if kind not in INPUT_MASKS:
            return (x,)
        keep = torch.rand(mask_shape(form, batch, length), generator=generator) > 0.3
        keep[..., 0, :] = False
        if kind == "input":
            return x, keep
        return x, torch.where(keep, 0.0, float("-inf")).to(dtype)

    return make


def masked_length(kind: str, form: str) -> LengthAxis:
    """The length axis of a pair: the sequence's dim 1 and, for a mask the caller
    gives, its last two dims; 2..MAX_LENGTH - 1, traced at 6."""
    axes: tuple[tuple[int, ...], ...] = ((1,),)
    if kind in INPUT_MASKS:
        rank = len(mask_shape(form, 1, 1))
        axes += ((rank - 2, rank - 1),)
    return LengthAxis(axes, 2, MAX_LENGTH - 1, 6)
