# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A transformer layer exported with a static and with a dynamic sequence decides alike.

Each pair exports one module twice, at one length, with and without a
`torch.export.Dim` on the sequence, and lowers both with etfold's
XnnpackPartitioner. The rewrites this pair guards (RMSNorm's mean, layer norm,
the softmax guard) take the same decisions in both, but for declines whose
reason is the dynamic shape; every decline of the dynamic lowering names it.
The dynamic program matches eager at both bounds and two lengths between.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes import (
    layer_norm_as_delegated_ops_pass,
    mean_over_last_dim_as_pooling_pass,
    safe_softmax_as_softmax_pass,
)
from etfold.harness.dynamic_pairs import (
    DYNAMIC_SHAPE_REASON,
    LengthAxis,
    StaticDynamicPair,
    decisions_apart,
    dynamic_errors,
    lower_static_and_dynamic,
)

REWRITES = frozenset(
    {
        mean_over_last_dim_as_pooling_pass.FOLD,
        layer_norm_as_delegated_ops_pass.FOLD,
        safe_softmax_as_softmax_pass.FOLD,
    }
)
NORMS_AND_GUARD = {
    "aten.mean.dim",
    "aten.native_layer_norm.default",
    "aten.any.dim",
    "aten.logical_not.default",
    "aten.full_like.default",
}


class RMSNorm(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(torch.nn.Module):
    """Multi-head attention over [1, t, width] by SDPA; grouped keys and values
    (`kv_heads` < `heads`) are repeated to every head, as Llama's are."""

    def __init__(self, width: int, heads: int, kv_heads: int, causal: bool):
        super().__init__()
        self.heads, self.kv_heads, self.causal = heads, kv_heads, causal
        self.head = width // heads
        self.q = torch.nn.Linear(width, width)
        self.kv = torch.nn.Linear(width, 2 * kv_heads * self.head)
        self.o = torch.nn.Linear(width, width)

    def forward(self, x):
        b, t, width = x.shape
        q = self.q(x).view(b, t, self.heads, self.head).transpose(1, 2)
        kv = self.kv(x).view(b, t, 2, self.kv_heads, self.head).permute(2, 0, 3, 1, 4)
        k, v = (kv[i].repeat_interleave(self.heads // self.kv_heads, dim=1) for i in (0, 1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o(y.transpose(1, 2).reshape(b, t, width))


class EncoderLayer(torch.nn.Module):
    """BERT's layer: attention and a GELU feed-forward, each added back and layer-normed."""

    def __init__(self, width: int = 32, heads: int = 4):
        super().__init__()
        self.attention = Attention(width, heads, heads, causal=False)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(2))
        self.up, self.down = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)

    def forward(self, x):
        x = self.norms[0](x + self.attention(x))
        return self.norms[1](x + self.down(F.gelu(self.up(x))))


class DecoderLayer(torch.nn.Module):
    """Llama's layer: RMSNorm before causal grouped-query attention and a SwiGLU."""

    def __init__(self, width: int = 32, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.norms = torch.nn.ModuleList(RMSNorm(width) for _ in range(2))
        self.attention = Attention(width, heads, kv_heads, causal=True)
        self.gate, self.up = torch.nn.Linear(width, 64), torch.nn.Linear(width, 64)
        self.down = torch.nn.Linear(64, width)

    def forward(self, x):
        x = x + self.attention(self.norms[0](x))
        h = self.norms[1](x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _sequence(width: int):
    def make(length: int) -> tuple[torch.Tensor]:
        generator = torch.Generator().manual_seed(length)
        return (torch.randn(1, length, width, generator=generator),)

    return make


def _pair(module: torch.nn.Module, width: int, axis: LengthAxis) -> StaticDynamicPair:
    return lower_static_and_dynamic(module, _sequence(width), axis, lambda: [XnnpackPartitioner()])


def assert_alike(pair: StaticDynamicPair) -> None:
    """The pair's contract: the rewrites decide alike, every dynamic-only decline names
    the dynamic shape, and the dynamic program is eager's at every length checked."""
    assert decisions_apart(pair, lambda fold: fold in REWRITES) == ({}, {})
    for decision in pair.dynamic.decisions:
        if decision.fold in REWRITES and not decision.applied:
            assert decision.detail.startswith(DYNAMIC_SHAPE_REASON), decision
    errors = dynamic_errors(pair)
    assert {pair.length.low, pair.length.high} <= set(errors) and len(errors) == 4
    assert max(errors.values()) <= 1e-4, errors


@functools.cache
def _layer(kind: str) -> StaticDynamicPair:
    torch.manual_seed(0)
    module = EncoderLayer() if kind == "encoder" else DecoderLayer()
    return _pair(module.eval(), 32, LengthAxis(((1,),), 2, 24, 7))


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_a_layer_decides_alike_static_and_dynamic_and_matches_eager(kind):
    pair = _layer(kind)
    assert_alike(pair)
    rewritten = [d for d in pair.dynamic.decisions if d.fold in REWRITES]
    assert rewritten and all(d.applied for d in rewritten)
    # norms and the guard run inside delegates in both programs, one delegate each
    for lowered in (pair.static, pair.dynamic):
        assert not NORMS_AND_GUARD & set(lowered.program.ops_outside())
        assert lowered.program.delegates() == 1


@pytest.mark.long  # generated layers; the hand-written decoder and encoder pairs stay short
@settings(max_examples=2, deadline=None, derandomize=True, database=None)
@given(
    heads=st.sampled_from([1, 2, 4]),
    causal=st.booleans(),
    low=st.integers(2, 4),
    span=st.integers(3, 12),
)
def test_generated_attention_layers_decide_alike_static_and_dynamic(heads, causal, low, span):
    torch.manual_seed(heads)
    module = torch.nn.Sequential(
        torch.nn.LayerNorm(16), Attention(16, heads, heads, causal), RMSNorm(16)
    ).eval()
    pair = _pair(module, 16, LengthAxis(((1,),), low, low + span, low + 1))
    assert_alike(pair)
