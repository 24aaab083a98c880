# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Audio declared in samples, as users declare it (`Dim.DYNAMIC(min=4000, max=32000)`):
two strided convolutions make its frames, whose count is a floordiv chain of the sample
count, and what the frames' attention reads is computed from that count alone. The
dynamic program gets its static twin's delegates and runs at every length its bounds
allow, 32,000 samples included."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from etfold.backends.xnnpack._passes.attention_mask_all_true_pass import FOLD as ALL_TRUE
from etfold.backends.xnnpack._passes.size_only_values_as_table_slices_pass import (
    FOLD as TABLES,
)
from etfold.harness.dynamic_pairs import (
    LengthAxis,
    assert_dynamic_matches_eager,
    decisions_apart,
    lower_xnnpack_pair,
)
from etfold.harness.sequence_models import SHORT_FEATURE_CONVS, tiny_wav2vec2
from etfold.harness.xnnpack_runner import eager_outputs, max_abs_error

SAMPLES = LengthAxis(((1,),), 4000, 32000, 16000, named=False)
# sizes the frames' values are read at, besides their own: symbolic sizes and their arithmetic
SIZE_BOOKKEEPING = {"aten.sym_size.int", "floordiv", "add", "sub", "mul"}


class FramesAttention(torch.nn.Module):
    """Samples through two strided convolutions (a frame per 40 samples), a sinusoidal
    position code of the frame count (`positions`), and one attention layer under the
    mask transformers' `sdpa_mask` builds for an input with no padding:
    `arange(frames) >= 0`, expanded to [1, 1, frames, frames]."""

    def __init__(self, width: int = 16, heads: int = 2, positions: bool = True):
        super().__init__()
        self.heads, self.positions = heads, positions
        self.conv1 = torch.nn.Conv1d(1, 8, 10, stride=5)
        self.conv2 = torch.nn.Conv1d(8, width, 8, stride=8)
        self.qkv, self.o = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        inv_freq = 1.0 / 100 ** (torch.arange(width // 2).float() / (width // 2))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, samples):
        h = F.gelu(self.conv2(F.gelu(self.conv1(samples[:, None])))).transpose(1, 2)
        b, frames, width = h.shape
        if self.positions:
            angles = torch.arange(frames).float()[:, None] * self.inv_freq[None]
            h = h + torch.cat([angles.sin(), angles.cos()], -1)
        kept = torch.arange(frames)[None, None, :, None] >= 0
        mask = kept.expand(b, 1, frames, frames)
        qkv = self.qkv(h).view(b, frames, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(*qkv, attn_mask=mask)
        return self.o(o.transpose(1, 2).reshape(b, frames, width))


def audio(samples: int) -> tuple[torch.Tensor]:
    return (torch.randn(1, samples, generator=torch.Generator().manual_seed(samples)),)


@functools.cache
def _pair():
    return lower_xnnpack_pair(FramesAttention, audio, SAMPLES)


def test_frames_of_samples_get_the_static_delegates_and_run_at_every_bound():
    pair = _pair()
    static, dynamic = pair.static.program, pair.dynamic.program
    assert dynamic.delegates() == static.delegates() == 1
    extra = dynamic.ops_outside() - static.ops_outside()
    # the position table's rows, sliced to the frame count
    assert extra.pop("aten.slice_copy.Tensor") == 1, extra
    assert set(extra) <= SIZE_BOOKKEEPING, extra
    static_only, dynamic_only = decisions_apart(pair, lambda fold: fold in (ALL_TRUE, TABLES))
    assert not static_only, static_only
    assert {(fold, applied) for fold, applied, _ in dynamic_only} == {(TABLES, True)}
    assert_dynamic_matches_eager(pair)
    # a length no whole number of frames makes
    inputs = audio(18001)
    assert max_abs_error(dynamic.run(*inputs), eager_outputs(pair.module, inputs)) <= 1e-5


@pytest.mark.long  # the short profile holds the same attention with its position code
def test_frames_of_samples_without_a_position_code_read_no_table():
    pair = lower_xnnpack_pair(lambda: FramesAttention(positions=False), audio, SAMPLES)
    static, dynamic = pair.static.program, pair.dynamic.program
    assert dynamic.delegates() == static.delegates() == 1
    assert set(dynamic.ops_outside() - static.ops_outside()) <= SIZE_BOOKKEEPING
    assert_dynamic_matches_eager(pair)


@pytest.mark.long  # 1-2 min; the short profile holds its identities on FramesAttention
def test_wav2vec2_declared_in_samples_gets_its_static_delegates_and_runs_at_every_bound():
    pair = lower_xnnpack_pair(
        lambda: tiny_wav2vec2(feature_convs=SHORT_FEATURE_CONVS), audio, SAMPLES
    )
    static, dynamic = pair.static.program, pair.dynamic.program
    assert dynamic.delegates() == static.delegates() == 2  # group norm runs between them
    assert set(dynamic.ops_outside() - static.ops_outside()) <= SIZE_BOOKKEEPING
    assert_dynamic_matches_eager(pair)
    inputs = audio(18001)
    assert max_abs_error(dynamic.run(*inputs), eager_outputs(pair.module, inputs)) <= 1e-5
