# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Unbind and stack along the last dim go through a transpose: the delegate copies rows
(interleaved rotary embedding's real/imaginary pairs), bit for bit."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from executorch.examples.models.llama.rope import apply_rotary_emb
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.last_dim_unbind_and_stack_transposed_pass import (
    FOLD,
    last_dim_unbinds_and_stacks_transposed,
)
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.inspection import lowered_modules
from etfold.harness.xnnpack_runner import lower_module_xnnpack

aten = torch.ops.aten


class Rotary(torch.nn.Module):
    """ExecuTorch llama's interleaved rotary embedding on q and k."""

    def forward(self, q, k, cos, sin):
        return apply_rotary_emb(q, k, cos, sin)


class Pairs(torch.nn.Module):
    """Pieces of the last dim combined elementwise, stacked back on a new last dim."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        pieces = x.unbind(self.dim)
        mixed = [p * (i + 1.5) - pieces[0] for i, p in enumerate(pieces)]
        return torch.stack(mixed, self.dim)


def _rotary_inputs(tokens: int = 6, heads: int = 3, head_dim: int = 16) -> tuple:
    gen = torch.Generator().manual_seed(tokens)
    q, k = (torch.randn(1, tokens, heads, head_dim, generator=gen) for _ in range(2))
    cos, sin = (torch.randn(tokens, head_dim // 2, generator=gen) for _ in range(2))
    return q, k, cos, sin


def _rewritten(module, inputs, dynamic_shapes=None):
    program = torch.export.export(module.eval(), inputs, dynamic_shapes=dynamic_shapes)
    with collect_decisions() as decisions:
        rewritten = last_dim_unbinds_and_stacks_transposed(program, bf16=False)
    return program, rewritten, [d for d in decisions if d.fold == FOLD]


def _targets(program) -> Counter:
    return Counter(n.target for n in program.graph.nodes if n.op == "call_function")


def test_unbind_and_stack_read_and_write_rows_of_a_transpose():
    program, rewritten, decisions = _rewritten(Pairs(), (torch.randn(2, 5, 3),))
    before, after = _targets(program), _targets(rewritten)
    assert before[aten.stack.default] == 1 and after[aten.stack.default] == 0
    assert after[aten.permute_copy.default] == 2 and after[aten.cat.default] == 1
    (unbind,) = [n for n in rewritten.graph.nodes if n.target is aten.unbind.int]
    assert unbind.args[0].target is aten.permute_copy.default and unbind.args[1] == 1
    assert [(d.applied, d.where) for d in decisions] == [(True, "unbind"), (True, "stack")]
    x = torch.randn(2, 5, 3)
    assert torch.equal(rewritten.module()(x), Pairs()(x))
    assert _targets(program) == before  # the program handed in is left alone


@functools.cache
def _lowered_rotary():
    inputs = _rotary_inputs()
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(
            Rotary(), inputs, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
        )
    return program, expected, inputs, [d for d in decisions if d.fold == FOLD]


def test_rotary_embedding_slices_rows_inside_one_delegate_bit_for_bit():
    program, expected, inputs, decisions = _lowered_rotary()
    assert program.delegates() == 1 and not program.ops_outside()
    assert sum(d.applied for d in decisions) == 4  # q and k: an unbind and a stack each
    (delegate,) = lowered_modules(program.edge.exported_program())
    ops = [n for n in delegate.original_module.graph.nodes if n.op == "call_function"]
    slices = [n for n in ops if "slice_copy" in str(n.target)]
    assert slices and all(n.args[1] == 3 for n in slices)  # rows, not the last dim's columns
    assert sum("permute_copy" in str(n.target) for n in ops) == 4
    assert all(torch.equal(a, e) for a, e in zip(program.run(*inputs), expected, strict=True))


def test_positive_and_negative_last_dim_decide_alike():
    x = torch.randn(2, 4, 2)
    decided = [[(d.applied, d.where) for d in _rewritten(Pairs(dim), (x,))[2]] for dim in (-1, 2)]
    assert decided[0] == decided[1] == [(True, "unbind"), (True, "stack")]


def test_declines_when_the_dim_before_the_last_has_size_one():
    program, rewritten, decisions = _rewritten(Pairs(), (torch.randn(3, 1, 2),))
    assert rewritten is program
    assert {d.detail for d in decisions} == {
        "the dim before the last has size 1: each piece is contiguous already"
    }


def test_declines_a_stack_of_a_dtype_xnnpack_does_not_copy_here():
    class IntPairs(torch.nn.Module):
        def forward(self, a, b):
            return torch.stack([a + 1, b], -1)

    ints = (torch.arange(8, dtype=torch.int32).view(2, 4),) * 2
    program, rewritten, decisions = _rewritten(IntPairs(), ints)
    assert rewritten is program
    (decision,) = decisions
    assert decision.detail.startswith("torch.int32 stack: XNNPACK takes")


def test_declines_a_stack_beyond_xnnpacks_rank():
    class Deep(torch.nn.Module):
        def forward(self, a):
            return torch.stack([a, a * 2.0], -1)

    program, rewritten, decisions = _rewritten(Deep(), (torch.randn(1, 2, 1, 2, 1, 3),))
    assert rewritten is program
    assert [d.detail for d in decisions] == ["rank 7 output: XNNPACK holds at most 6 dims"]


def test_leaves_unbinds_and_stacks_along_other_dims_alone():
    class Other(torch.nn.Module):
        def forward(self, x):
            first, second = x.unbind(1)
            return torch.stack([first, second * 2.0], 0)

    program, rewritten, decisions = _rewritten(Other(), (torch.randn(3, 2, 4),))
    assert rewritten is program and decisions == []


@pytest.mark.parametrize("tokens", [2, 23, 40], ids=["min", "between", "max"])
def test_dynamic_rotary_embedding_rewritten_matches_eager_bit_for_bit(tokens):
    length = torch.export.Dim("tokens", min=2, max=40)
    dims = ({1: length}, {1: length}, {0: length}, {0: length})
    program, rewritten, decisions = _rewritten(Rotary(), _rotary_inputs(), dims)
    assert sum(d.applied for d in decisions) == 4
    inputs = _rotary_inputs(tokens)
    actual, expected = rewritten.module()(*inputs), Rotary()(*inputs)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))


@settings(max_examples=25, deadline=None)
@given(
    leading=st.lists(st.integers(1, 3), min_size=0, max_size=3),
    rows=st.integers(1, 5),
    pieces=st.integers(2, 4),
    seed=st.integers(0, 2**16),
)
def test_generated_pairs_rewrite_exactly_when_rows_are_longer_than_one(leading, rows, pieces, seed):
    x = torch.randn(*leading, rows, pieces, generator=torch.Generator().manual_seed(seed))
    program, rewritten, decisions = _rewritten(Pairs(), (x,))
    assert {d.applied for d in decisions} == {rows > 1}
    assert (rewritten is program) == (rows == 1)
    assert torch.equal(rewritten.module()(x), Pairs()(x))
