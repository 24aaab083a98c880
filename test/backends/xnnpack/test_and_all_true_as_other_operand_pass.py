# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A padding mask `&` the query positions' `>= 0` (transformers' `sdpa_mask`) is the
padding mask, static or dynamic: the positions' arange chain goes."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.and_all_true_as_other_operand_pass import (
    FOLD,
    ands_all_true_as_other_operand,
)
from etfold.decisions import collect_decisions
from etfold.harness.dynamic_pairs import (
    LengthAxis,
    decisions_apart,
    dynamic_errors,
    lower_static_and_dynamic,
)

AND = "aten.__and__.Tensor"


class PaddedAttention(torch.nn.Module):
    """Attention under a [1, t] int padding mask `&` every query position's `>= 0`."""

    def __init__(self, width: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv, self.o = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x, keep):
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        queries = torch.arange(t)[None, None, :, None]
        mask = keep.bool()[:, None, None, :] & (queries >= 0)
        y = F.scaled_dot_product_attention(*qkv, attn_mask=mask.expand(b, -1, t, t))
        return self.o(y.transpose(1, 2).reshape(b, t, d))


def _inputs(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(1, length, 16, generator=torch.Generator().manual_seed(length))
    keep = torch.ones(1, length, dtype=torch.long)
    keep[0, length - length // 3 :] = 0
    return x, keep


AXIS = LengthAxis(((1,), (1,)), 2, 16, 6)


@functools.cache
def _pair():
    torch.manual_seed(0)
    return lower_static_and_dynamic(
        PaddedAttention(), _inputs, AXIS, lambda: [XnnpackPartitioner()]
    )


def test_the_positions_go_static_and_dynamic_alike():
    pair = _pair()
    for lowered in (pair.static, pair.dynamic):
        (decision,) = [d for d in lowered.decisions if d.fold == FOLD]
        assert decision.applied and "is True everywhere" in decision.detail
        outside = lowered.program.ops_outside()
        assert not {"aten.bitwise_and.Tensor", "aten.ge.Scalar", "aten.arange.start_step"} & set(
            outside
        ), outside
    static_only, dynamic_only = decisions_apart(pair, lambda fold: fold == FOLD)
    assert not static_only and not dynamic_only
    errors = dynamic_errors(pair)
    assert {AXIS.low, AXIS.high} <= set(errors) and max(errors.values()) <= 1e-5, errors


class Anded(torch.nn.Module):
    """`keep[:, None, :] & positions(t)`, read by `read` (and returned when `returns`);
    a buffer `flag` of True."""

    def __init__(self, positions, read, returns: bool = False):
        super().__init__()
        self.positions, self.read, self.returns = positions, read, returns
        self.register_buffer("flag", torch.ones(1, 1, 1, dtype=torch.bool))

    def forward(self, x, keep):
        mask = keep.bool()[:, None, :] & self.positions(self, x.shape[1])
        out = torch.where(self.read(mask, x), x, 0.0)
        return (out, mask) if self.returns else (out,)


def _at_or_after(first: int):
    return lambda _, t: torch.arange(t)[:, None] >= first


def _written_flag(module, t):
    module.flag.fill_(True)
    return module.flag


def _expanded(mask, x):
    return mask.expand(2, x.shape[1], x.shape[1])


CASES = {
    "applies": (_at_or_after(0), _expanded),
    "holds a False": (_at_or_after(1), _expanded),
    "reads it, not an expand": (_at_or_after(0), lambda mask, x: mask),
    "keeps (-1) a size": (_at_or_after(0), lambda mask, x: mask.expand(2, -1, x.shape[1])),
    "is written in this method": (_written_flag, _expanded),
    "the program returns it": (_at_or_after(0), _expanded, True),
}


def _export(case: str) -> torch.export.ExportedProgram:
    length = torch.export.Dim("length", min=2, max=16)
    inputs = (torch.randn(2, 6, 6), torch.ones(1, 6, dtype=torch.long))
    return torch.export.export(
        Anded(*CASES[case]), inputs, dynamic_shapes=({1: length, 2: length}, {1: length})
    )


def test_the_graph_reads_the_other_operand():
    program = _export("applies")
    with collect_decisions() as decisions:
        rewritten = ands_all_true_as_other_operand(program)
    ops = Counter(str(n.target) for n in rewritten.graph.nodes if n.op == "call_function")
    assert ops[AND] == 0 and ops["aten.ge.Scalar"] == 0 and ops["aten.arange.default"] == 0
    assert [(d.applied, d.where) for d in decisions if d.fold == FOLD] == [(True, "and_1")]
    x, keep = torch.randn(2, 9, 9), torch.randint(0, 2, (1, 9))
    assert torch.equal(rewritten.module()(x, keep)[0], program.module()(x, keep)[0])


@pytest.mark.parametrize("reason", [case for case in CASES if case != "applies"])
def test_declines_when(reason):
    program = _export(reason)
    code = program.graph_module.code
    with collect_decisions() as decisions:
        assert ands_all_true_as_other_operand(program) is program
    assert program.graph_module.code == code
    (declined,) = [d for d in decisions if d.fold == FOLD]
    # the user's mask is never the operand that goes
    assert not declined.applied and "reads the values of user input keep" in declined.detail
    assert reason in declined.detail, declined.detail
