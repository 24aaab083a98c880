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

from etfold.backends.xnnpack._passes.and_all_true_as_other_operand_pass import (
    FOLD,
    ands_all_true_as_other_operand,
)
from etfold.decisions import collect_decisions
from etfold.harness.dynamic_pairs import (
    assert_dynamic_matches_eager,
    decisions_apart,
    lower_xnnpack_pair,
)
from etfold.harness.sequence_models import PADDED_LENGTH, PaddedAttention, padded_inputs

AND = "aten.__and__.Tensor"


def _anded_with_the_queries(keep, b, t):
    """The [1, t] padding mask `&` every query position's `>= 0`, expanded."""
    queries = torch.arange(t)[None, None, :, None]
    mask = keep.bool()[:, None, None, :] & (queries >= 0)
    return mask.expand(b, -1, t, t)


@functools.cache
def _pair():
    return lower_xnnpack_pair(
        lambda: PaddedAttention(_anded_with_the_queries), padded_inputs, PADDED_LENGTH
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
    assert_dynamic_matches_eager(pair)


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


def _ones(module, t):
    return torch.ones(t, 1, dtype=torch.bool)


def _new_ones(module, t):
    return module.flag.new_ones(t, 1)  # the buffer's dtype, not its values


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


SAME_TRUE = {"applies": _at_or_after(0), "ones": _ones, "new_ones": _new_ones}


def _export(case: str, positions=None) -> torch.export.ExportedProgram:
    """`case`'s module (its all-True operand spelled by `positions` when given)."""
    length = torch.export.Dim("length", min=2, max=16)
    inputs = (torch.randn(2, 6, 6), torch.ones(1, 6, dtype=torch.long))
    case_positions, *rest = CASES[case]
    return torch.export.export(
        Anded(positions or case_positions, *rest),
        inputs,
        dynamic_shapes=({1: length, 2: length}, {1: length}),
    )


@pytest.mark.parametrize("spelling", SAME_TRUE)
def test_the_graph_reads_the_other_operand(spelling):
    program = _export("applies", SAME_TRUE[spelling])
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
