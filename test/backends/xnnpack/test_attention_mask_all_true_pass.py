# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Attention drops a boolean mask True everywhere at every size (an encoder's mask
built without a padding mask)."""

from __future__ import annotations

import functools
import re

import pytest
import torch

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.attention_mask_all_true_pass import (
    FOLD,
    attention_masks_all_true_dropped,
)
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.dynamic_shapes import lower_dynamic

SDPA = torch.ops.aten.scaled_dot_product_attention.default


class Encoder(torch.nn.Module):
    """Attention over [1, s, 16] with the mask `kind` gives: "all_true" is transformers'
    `arange(s) >= 0` expanded (True at every length), "causal" is False above the
    diagonal, "ones" a constant all-True mask ("ones_like", "new_ones": filled at the
    length), "user" the caller's."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.project = torch.nn.Linear(16, 48)

    def mask(self, length: int, user: torch.Tensor | None) -> torch.Tensor:
        positions = torch.arange(length)
        if self.kind == "all_true":
            return (positions >= 0)[None, None, None, :].expand(1, 1, length, length)
        if self.kind == "causal":
            return positions[None, :] <= positions[:, None]
        if self.kind == "ones":
            return torch.ones(length, length, dtype=torch.bool)
        if self.kind == "ones_like":  # a fill shaped like the positions' outer product
            return torch.ones_like(positions[:, None] * positions, dtype=torch.bool)
        if self.kind == "new_ones":
            return positions.new_ones((1, 1, length, length), dtype=torch.bool)
        return user

    def forward(self, x, user=None):
        q, k, v = (t.view(1, -1, 2, 8).transpose(1, 2) for t in self.project(x).split(16, -1))
        attention = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask(x.shape[1], user)
        )
        return attention.transpose(1, 2).reshape(1, -1, 16)


def _rewritten(kind: str, inputs: tuple, dynamic_shapes=None):
    program = torch.export.export(Encoder(kind).eval(), inputs, dynamic_shapes=dynamic_shapes)
    with collect_decisions() as decisions:
        rewritten = attention_masks_all_true_dropped(program)
    return program, rewritten, [(d.applied, d.detail) for d in decisions if d.fold == FOLD]


def _masks(program) -> list:
    (attention,) = program.graph.find_nodes(op="call_function", target=SDPA)
    return [arg for arg in attention.args[3:4] if arg is not None]


def test_a_constant_all_true_mask_is_dropped():
    inputs = (torch.randn(1, 6, 16),)
    program, rewritten, decisions = _rewritten("ones", inputs)
    assert decisions == [(True, "the mask `ones` is True everywhere at each of its 1 sizes")]
    assert _masks(program) and not _masks(rewritten)
    torch.testing.assert_close(rewritten.module()(*inputs), program.module()(*inputs))


def test_a_mask_false_somewhere_stays_and_names_the_size():
    tokens = torch.export.Dim("tokens", min=2, max=9)
    program, rewritten, decisions = _rewritten(
        "causal", (torch.randn(1, 6, 16),), dynamic_shapes=({1: tokens},)
    )
    assert rewritten is program
    ((applied, detail),) = decisions
    assert not applied
    assert re.fullmatch(r"the mask `le\w*` is False somewhere at s\d+ = 2: it masks scores", detail)


def test_a_users_mask_stays_and_says_why():
    inputs = (torch.randn(1, 6, 16), torch.ones(6, 6, dtype=torch.bool))
    program, rewritten, decisions = _rewritten("user", inputs)
    assert rewritten is program
    assert decisions == [(False, "`user` reads the values of user input user")]


@pytest.mark.parametrize("kind", ["all_true", "ones", "ones_like", "new_ones"])
def test_every_spelling_of_an_all_true_mask_is_dropped_at_every_length(kind):
    tokens = torch.export.Dim("tokens", min=2, max=9)
    inputs = (torch.randn(1, 6, 16),)
    program, rewritten, decisions = _rewritten(kind, inputs, dynamic_shapes=({1: tokens},))
    ((applied, detail),) = decisions
    assert applied and detail.endswith("is True everywhere at each of its 8 sizes"), detail
    assert _masks(program) and not _masks(rewritten)
    for length in (2, 5, 9):
        x = torch.randn(1, length, 16)
        torch.testing.assert_close(rewritten.module()(x), program.module()(x))


@functools.cache
def _dynamic_encoder():
    module = Encoder("all_true").eval()
    tokens = torch.export.Dim("tokens", min=2, max=24)
    program, decisions = lower_dynamic(
        module,
        (torch.randn(1, 7, 16),),
        ({1: tokens},),
        [XnnpackPartitioner()],
        lower=to_edge_transform_and_lower,
    )
    return module, program, [(d.applied, d.detail) for d in decisions if d.fold == FOLD]


def test_an_encoders_length_mask_is_dropped_and_the_layer_is_one_delegate():
    _, program, decisions = _dynamic_encoder()
    ((applied, detail),) = decisions
    assert applied and detail.endswith("is True everywhere at each of its 23 sizes")
    assert program.delegates() == 1 and not program.ops_outside()


@pytest.mark.parametrize("tokens", [2, 13, 24], ids=["min", "between", "max"])
def test_the_dynamic_encoder_matches_eager_at_each_length(tokens):
    module, program, _ = _dynamic_encoder()
    x = torch.randn(1, tokens, 16)
    torch.testing.assert_close(program.run(x)[0], module(x), atol=1e-5, rtol=1e-5)
