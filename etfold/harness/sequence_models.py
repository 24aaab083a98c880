# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Sequence inputs of a given length, and attention under a user's padding mask, for
the static/dynamic pairs of the rewrites a dynamic BERT needs.

`token_ids` and `padded_inputs` draw the same inputs for a length every time, so a
pair is checked at each length on the same values. `PaddedAttention` is one attention
layer whose [1, t] padding mask is turned into SDPA's mask by a function the test
gives: each mask rewrite is tested on the form transformers' `sdpa_mask` writes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from etfold.harness.dynamic_pairs import LengthAxis

WIDTH = 16
# token ids of length 2..32 (a position table's 32 rows), traced at 6
TOKEN_LENGTH = LengthAxis(((1,),), 2, 32, 6)
# a padded sequence and its mask share the length, 2..16, traced at 6
PADDED_LENGTH = LengthAxis(((1,), (1,)), 2, 16, 6)


def token_ids(length: int, vocab: int = 50) -> tuple[torch.Tensor]:
    """[1, length] token ids below `vocab`, drawn from the length as seed."""
    generator = torch.Generator().manual_seed(length)
    return (torch.randint(0, vocab, (1, length), generator=generator),)


def padded_inputs(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [1, length, WIDTH] sequence drawn from the length as seed, and its [1, length]
    int padding mask (1: a token, 0: padding) hiding the last third."""
    x = torch.randn(1, length, WIDTH, generator=torch.Generator().manual_seed(length))
    keep = torch.ones(1, length, dtype=torch.long)
    keep[0, length - length // 3 :] = 0
    return x, keep


Mask = Callable[[torch.Tensor, int, int], torch.Tensor]


class PaddedAttention(torch.nn.Module):
    """Attention under `mask(keep, b, t)`: SDPA's bool mask built from the [1, t] int
    padding mask `keep`."""

    def __init__(self, mask: Mask, width: int = WIDTH, heads: int = 2):
        super().__init__()
        self.mask, self.heads = mask, heads
        self.qkv, self.o = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x, keep):
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(*qkv, attn_mask=self.mask(keep, b, t))
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class LastHiddenState(torch.nn.Module):
    """`x -> model(x).last_hidden_state`: a transformers encoder as one tensor's function."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).last_hidden_state


def tiny_wav2vec2(
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    conv_channels: int = 64,
    feature_convs: tuple[tuple[int, int], ...] | None = None,
) -> torch.nn.Module:
    """transformers' Wav2Vec2Model with random weights: feature convs of `conv_channels`,
    (kernel, stride) each as `feature_convs` says (default: transformers' 7, a frame per
    320 samples), an even-kernel positional conv, SDPA attention."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    convs = {}
    if feature_convs is not None:
        convs = dict(
            conv_kernel=tuple(kernel for kernel, _ in feature_convs),
            conv_stride=tuple(stride for _, stride in feature_convs),
        )
    config = Wav2Vec2Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        conv_dim=(conv_channels,) * len(feature_convs or (None,) * 7),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        attn_implementation="sdpa",
        **convs,
    )
    return LastHiddenState(Wav2Vec2Model(config)).eval()


# three feature convs, a frame per 20 samples: audio in samples stays small enough to test
SHORT_FEATURE_CONVS = ((10, 5), (3, 2), (3, 2))
