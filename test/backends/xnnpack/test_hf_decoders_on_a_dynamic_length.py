# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""transformers' Llama on a dynamic sequence and wav2vec2 on a dynamic length of audio
get the delegates of their static exports, and match eager at every checked length
(the long profile: 10-20 s each; the rewrites they need are proven in the short one)."""

from __future__ import annotations

import functools

import pytest
import torch

from etfold.demo_models.mixed_precision_decoders import tiny_llama
from etfold.harness.dynamic_pairs import (
    LengthAxis,
    assert_dynamic_matches_eager,
    lower_xnnpack_pair,
)
from etfold.harness.sequence_models import tiny_wav2vec2, token_ids

TOKENS = LengthAxis(((1,),), 4, 48, 16)
# whole frames of 320 samples: torch.export proves the attention's reshapes only for those
FRAMES = 320
AUDIO = LengthAxis(((1,),), 13 * FRAMES, 40 * FRAMES, 20 * FRAMES, step=FRAMES)


def _llama() -> torch.nn.Module:
    return tiny_llama(torch.float32, hidden=64, vocab=50, layers=1)


@functools.cache
def _llama_pair():
    return lower_xnnpack_pair(_llama, token_ids, TOKENS)


@pytest.mark.long  # the short profile holds the same rewrite on an HF-shaped attention
def test_a_dynamic_llama_gets_its_static_delegates_with_one_table_sliced_outside():
    pair = _llama_pair()
    static, dynamic = pair.static.program, pair.dynamic.program
    assert dynamic.delegates() == static.delegates()
    extra = dynamic.ops_outside() - static.ops_outside()
    # the mask and rotary table's rows, then the mask's columns, both to the length
    assert extra == {"aten.slice_copy.Tensor": 2, "aten.sym_size.int": 1}, extra
    assert_dynamic_matches_eager(pair)


def _wav2vec2() -> torch.nn.Module:
    return tiny_wav2vec2(hidden=32, layers=1, heads=2, conv_channels=16)


def audio(samples: int) -> tuple[torch.Tensor]:
    return (torch.randn(1, samples, generator=torch.Generator().manual_seed(samples)),)


@pytest.mark.long  # the short profile holds the conv's rewrite on a wav2vec2-shaped block
def test_a_dynamic_wav2vec2_gets_its_static_delegates():
    pair = lower_xnnpack_pair(_wav2vec2, audio, AUDIO)
    static, dynamic = pair.static.program, pair.dynamic.program
    assert dynamic.delegates() == static.delegates()
    extra = dynamic.ops_outside() - static.ops_outside()
    assert set(extra) <= {"aten.sym_size.int"}, extra
    assert_dynamic_matches_eager(pair)
