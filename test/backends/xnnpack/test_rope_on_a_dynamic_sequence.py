# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""ExecuTorch llama's rotary embedding (real/imaginary unbind, stack, flatten) on a
dynamic sequence runs inside one delegate, bit for bit."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from executorch.examples.models.llama.rope import apply_rotary_emb

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.split_as_slices_pass import FOLD, splits_as_slices
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.dynamic_shapes import lower_dynamic

HEADS, HEAD_DIM = 4, 16


class Rotary(torch.nn.Module):
    """q and k of [1, T, H, D] rotated by the tables of [T, D/2] (llama's rope.py)."""

    def forward(self, q, k, cos, sin):
        return apply_rotary_emb(q, k, cos, sin)


def _inputs(tokens: int) -> tuple:
    gen = torch.Generator().manual_seed(tokens)
    heads = [torch.randn(1, tokens, HEADS, HEAD_DIM, generator=gen) for _ in range(2)]
    tables = [torch.randn(tokens, HEAD_DIM // 2, generator=gen) for _ in range(2)]
    return (*heads, *tables)


@functools.cache
def _lowered(dynamic: bool):
    tokens = torch.export.Dim("tokens", min=2, max=48)
    dims = ({1: tokens}, {1: tokens}, {0: tokens}, {0: tokens}) if dynamic else None
    program, decisions = lower_dynamic(
        Rotary(), _inputs(6), dims, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
    )
    return program, [d for d in decisions if d.fold == FOLD]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_rotary_embedding_is_one_delegate(dynamic):
    program, decisions = _lowered(dynamic)
    assert program.delegates() == 1 and not program.ops_outside()
    assert [(d.applied, d.detail) for d in decisions] == [
        (True, "2 slabs along dim 3 as views")
    ] * 2


@pytest.mark.parametrize("tokens", [2, 29, 48], ids=["min", "between", "max"])
def test_dynamic_rotary_embedding_matches_eager_bit_for_bit(tokens):
    program, _ = _lowered(True)
    inputs = _inputs(tokens)
    actual = program.run(*inputs)
    expected = Rotary()(*inputs)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))


def test_a_select_along_the_dynamic_dim_stays_naming_it():
    class LastToken(torch.nn.Module):
        def forward(self, x):
            return (x * 2.0).select(1, 0)

    tokens = torch.export.Dim("tokens", min=2, max=8)
    program = torch.export.export(
        LastToken(), (torch.randn(1, 4, 8),), dynamic_shapes=({1: tokens},)
    )
    with collect_decisions() as decisions:
        assert splits_as_slices(program, bf16=False) is program
    (reason,) = [d.detail for d in decisions if d.fold == FOLD]
    assert re.fullmatch(
        r"dynamic shape: selects along dim 1 \(s\d+ in 2\.\.8\); the slice bounds change with "
        r"the input",
        reason,
    )
