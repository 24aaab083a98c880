# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A lookup of the positions 0..s-1 is the table's first s rows on a dynamic sequence,
however the user wrote them (BERT's `position_ids[:, :s]` of a buffer 0..max-1, GPT-2's
`arange(s)`, an arange expanded over the batch): one slice outside, no lookup."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

from etfold.backends.xnnpack._passes.embedding_of_positions_as_table_slice_pass import (
    FOLD,
    embeddings_of_positions_as_table_slices,
)
from etfold.decisions import collect_decisions
from etfold.exir.program.lower import mark_for_lowering
from etfold.harness.dynamic_pairs import (
    assert_dynamic_matches_eager,
    decisions_apart,
    lower_xnnpack_pair,
)
from etfold.harness.sequence_models import TOKEN_LENGTH, token_ids

EMBEDDING = "aten.embedding.default"


def _read(module, s):
    return module.position_ids[:, :s]


def _arange(module, s):
    return torch.arange(s)


def _arange_over_batch(module, s):
    return torch.arange(0, s, dtype=torch.long).unsqueeze(0).expand(1, -1)


def _written(module, s):
    module.position_ids.add_(0)
    return module.position_ids[:, :s]


class Positions(torch.nn.Module):
    """Word and position embeddings, added and projected; `positions` reads the ids."""

    def __init__(self, rows: int = 32, first: int = 0, positions=_read, width: int = 16):
        super().__init__()
        self.positions = positions
        self.words = torch.nn.Embedding(50, width)
        self.table = torch.nn.Embedding(rows, width)
        self.register_buffer("position_ids", torch.arange(first, first + 32)[None], False)
        self.out = torch.nn.Linear(width, width)

    def forward(self, ids):
        return self.out(self.words(ids) + self.table(self.positions(self, ids.shape[1])))


@functools.cache
def _pair():
    return lower_xnnpack_pair(Positions, token_ids, TOKEN_LENGTH)


def test_the_dynamic_positions_are_the_tables_rows():
    pair = _pair()
    static_only, dynamic_only = decisions_apart(pair, lambda fold: fold == FOLD)
    # static positions: constant propagation folds the lookup, nothing to decide
    assert not static_only and dynamic_only == Counter({(FOLD, True, ""): 1})
    outside = pair.dynamic.program.ops_outside()
    assert outside[EMBEDDING] == 1, outside  # the words' lookup alone
    assert outside["aten.slice_copy.Tensor"] == 1  # the table's rows, to the length
    assert_dynamic_matches_eager(pair)


def _export(module: torch.nn.Module, marked: bool = True) -> torch.export.ExportedProgram:
    program = torch.export.export(
        module.eval(), token_ids(6), dynamic_shapes=TOKEN_LENGTH.dynamic_shapes()
    )
    if marked:
        mark_for_lowering({"forward": program})  # as etfold's entry point marks its copy
    return program


SAME_POSITIONS = {"buffer": _read, "arange": _arange, "arange_over_batch": _arange_over_batch}


@pytest.mark.parametrize("spelling", SAME_POSITIONS)
def test_the_graph_slices_the_table(spelling):
    program = _export(Positions(positions=SAME_POSITIONS[spelling]))
    with collect_decisions() as decisions:
        rewritten = embeddings_of_positions_as_table_slices(program)
    ops = Counter(str(n.target) for n in rewritten.graph.nodes if n.op == "call_function")
    assert ops[EMBEDDING] == 1 and ops["aten.slice.Tensor"] == 1, ops
    (applied,) = [d for d in decisions if d.fold == FOLD]
    assert applied.applied and applied.detail.startswith("the first "), applied
    for length in (2, 17, 32):
        (ids,) = token_ids(length)
        assert torch.equal(rewritten.module()(ids), program.module()(ids))


def test_arange_positions_lower_as_the_buffers_do():
    """GPT-2's `arange(s)` positions: the same decisions and ops outside as BERT's
    buffer on a dynamic sequence, and eager's values at each length."""
    written = lower_xnnpack_pair(
        functools.partial(Positions, positions=_arange), token_ids, TOKEN_LENGTH
    )
    assert written.dynamic.program.ops_outside() == _pair().dynamic.program.ops_outside()
    assert written.dynamic.program.delegates() == _pair().dynamic.program.delegates()
    assert [d.applied for d in written.dynamic.decisions if d.fold == FOLD] == [True]
    assert_dynamic_matches_eager(written)


CASES = {
    "is not 0, 1, .., n - 1": dict(first=1),
    "has fewer rows than": dict(rows=16),
    "is written in this method": dict(positions=_written),
    "was not judged across methods": dict(),
}


@pytest.mark.parametrize("reason", CASES)
def test_declines_when(reason):
    program = _export(Positions(**CASES[reason]), marked=reason != "was not judged across methods")
    code = program.graph_module.code
    with collect_decisions() as decisions:
        assert embeddings_of_positions_as_table_slices(program) is program
    assert program.graph_module.code == code
    declined = [d for d in decisions if d.fold == FOLD]
    assert [d.applied for d in declined] == [False] and reason in declined[0].detail, declined
