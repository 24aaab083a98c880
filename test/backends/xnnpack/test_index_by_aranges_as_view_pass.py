# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A tensor read through an index of coordinate aranges, `x[arange(b)[..], arange(s)[..]]`
(transformers' `sdpa_mask` reads its padding mask so; a user's own grid alike), is a view
of it, static or dynamic, at every size."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack._passes.index_by_aranges_as_view_pass import (
    FOLD,
    index_by_aranges_as_view,
    inserted_axes,
)
from etfold.decisions import collect_decisions
from etfold.harness.dynamic_pairs import (
    assert_dynamic_matches_eager,
    decisions_apart,
    lower_xnnpack_pair,
)
from etfold.harness.sequence_models import PADDED_LENGTH, PaddedAttention, padded_inputs

INDEX = "aten.index.Tensor"
ARANGE = "aten.arange.start_step"


def _indexed_as_sdpa_mask(keep, b, t):
    """The [1, t] padding mask read as transformers' sdpa_mask reads it: indexed by the
    batch and key positions, `&` the query positions' `>= 0`, expanded."""
    batch = torch.arange(b)[:, None, None, None]
    queries = torch.arange(t)[None, None, :, None]
    keys = torch.arange(t)[None, None, None, :]
    mask = keep.bool()[batch, keys] & (queries >= 0)
    return mask.expand(b, -1, t, t)


def _masked_attention() -> PaddedAttention:
    return PaddedAttention(_indexed_as_sdpa_mask)


@functools.cache
def _pair():
    return lower_xnnpack_pair(_masked_attention, padded_inputs, PADDED_LENGTH)


def test_the_mask_index_is_a_view_static_and_dynamic_alike():
    pair = _pair()
    for lowered in (pair.static, pair.dynamic):
        (decision,) = [d for d in lowered.decisions if d.fold == FOLD]
        assert decision.applied and decision.detail.startswith("reads `")
        outside = lowered.program.ops_outside()
        assert INDEX not in outside and ARANGE not in outside, outside
    static_only, dynamic_only = decisions_apart(pair, lambda fold: fold == FOLD)
    assert not static_only and not dynamic_only
    # (static SDPA under a user mask keeps its expands outside: measured, not these passes')
    assert pair.dynamic.program.delegates() <= pair.static.program.delegates()
    assert_dynamic_matches_eager(pair)


def test_the_graph_reads_the_mask_as_a_view():
    program = torch.export.export(
        _masked_attention().eval(), padded_inputs(6), dynamic_shapes=PADDED_LENGTH.dynamic_shapes()
    )
    rewritten = index_by_aranges_as_view(program)
    ops = Counter(str(n.target) for n in rewritten.graph.nodes if n.op == "call_function")
    assert ops[INDEX] == 0 and ops["aten.view.default"] >= 1
    # the key positions' arange, its add and unsqueezes are gone; the queries' stays
    assert (
        ops["aten.arange.default"]
        < Counter(str(n.target) for n in program.graph.nodes if n.op == "call_function")[
            "aten.arange.default"
        ]
    )
    assert Counter(str(n.target) for n in program.graph.nodes)[INDEX] == 1  # the user's, kept


class Indexed(torch.nn.Module):
    """`x[rows, cols]` for index tensors `pick` builds from the length (and `extra`)."""

    def __init__(self, pick):
        super().__init__()
        self.pick = pick

    def forward(self, x, extra):
        return (self.pick(x, extra).float() * 2.0,)


def _keys(t: int) -> torch.Tensor:
    return torch.arange(t)[None, :]


PICKS = {
    "indexes 1 of the 2 dims": lambda x, e: x[:, torch.arange(x.shape[1])],
    "not [1, s": lambda x, e: x[torch.zeros(1, 1, dtype=torch.long), _keys(x.shape[1]).T],
    "not known contiguous": lambda x, e: x.expand(2, -1)[
        torch.arange(2)[:, None], _keys(x.shape[1])
    ],
    "reads the values of user input": lambda x, e: x[torch.zeros(1, 1, dtype=torch.long), e],
    "is not the coordinate of dim 1": lambda x, e: x[
        torch.zeros(1, 1, dtype=torch.long), _keys(x.shape[1]).flip(1)
    ],
}


def test_a_users_own_grid_of_aranges_is_a_view():
    """`x[arange(b)[:, None], arange(s)]` on a [b, s] tensor, dims read from the input:
    the same identity as transformers' four-axis mask index."""
    length = torch.export.Dim("length", min=2, max=16)
    grid = Indexed(
        lambda x, e: x[torch.arange(x.shape[0])[:, None], torch.arange(x.shape[1])][None]
    )
    x, extra = torch.randn(3, 6), torch.arange(6)[None]
    program = torch.export.export(
        grid.eval(), (x, extra), dynamic_shapes=({1: length}, {1: length})
    )
    with collect_decisions() as decisions:
        rewritten = index_by_aranges_as_view(program)
    ops = Counter(str(n.target) for n in rewritten.graph.nodes if n.op == "call_function")
    assert ops[INDEX] == 0 and ops["aten.arange.default"] == 0, ops
    assert [d.applied for d in decisions if d.fold == FOLD] == [True]
    for columns in (2, 9, 16):
        x, extra = torch.randn(3, columns), torch.arange(columns)[None]
        assert torch.equal(rewritten.module()(x, extra)[0], program.module()(x, extra)[0])


@pytest.mark.parametrize("reason", PICKS)
def test_declines_when(reason):
    length = torch.export.Dim("length", min=2, max=16)
    x, extra = torch.randn(1, 6), torch.arange(6)[None]
    program = torch.export.export(
        Indexed(PICKS[reason]).eval(), (x, extra), dynamic_shapes=({1: length}, {1: length})
    )
    code = program.graph_module.code
    with collect_decisions() as decisions:
        assert index_by_aranges_as_view(program) is program
    assert program.graph_module.code == code
    (declined,) = [d for d in decisions if d.fold == FOLD]
    assert not declined.applied and reason in declined.detail, declined.detail


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    source=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    ones=st.lists(st.integers(0, 3), max_size=3),
)
def test_inserted_axes_place_each_dim_where_a_view_puts_it(source, ones):
    out = list(source)
    for at in ones:
        out.insert(min(at, len(out)), 1)
    axes = inserted_axes(tuple(source), tuple(out))
    assert axes is not None and list(axes) == sorted(axes)
    assert [out[a] for a in axes] == source
    assert all(size == 1 for axis, size in enumerate(out) if axis not in axes)
