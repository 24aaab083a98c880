# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Token types that are one index at every length are one row of their table, however
the user wrote them (BERT's buffer of zeros read up to the length, `zeros(1, s)`,
`zeros_like(ids)`, `ids.new_zeros(...)`): on a dynamic sequence the row joins the
delegate's add, as the folded lookup does on a static one."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

from etfold.backends.xnnpack._passes.embedding_of_one_index_as_row_pass import (
    FOLD,
    embeddings_of_one_index_as_rows,
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


def _buffer_types(module, ids):
    """transformers' BertEmbeddings: the buffer, expanded, gathered at the positions."""
    s = ids.shape[1]
    positions = module.position_ids[:, :s]
    return module.token_type_ids.expand(1, -1).gather(1, positions).expand(1, s)


def _zeros(module, ids):
    return torch.zeros((1, ids.shape[1]), dtype=torch.long)


def _zeros_like(module, ids):
    return torch.zeros_like(ids)


def _new_zeros(module, ids):
    return ids.new_zeros(ids.shape)


def _fives(module, ids):
    return torch.full((1, ids.shape[1]), 5, dtype=torch.long)


def _written(module, ids):
    module.token_type_ids.zero_()
    return module.token_type_ids[:, : ids.shape[1]]


def _positions(module, ids):
    return module.position_ids[:, : ids.shape[1]]


def _added(words, types):
    return words + types


class Embeddings(torch.nn.Module):
    """Word, token-type and position embeddings, added, normalized and projected."""

    def __init__(self, types=_buffer_types, combine=_added, width: int = 16):
        super().__init__()
        self.types, self.combine = types, combine
        self.words = torch.nn.Embedding(50, width)
        self.type_table = torch.nn.Embedding(2, width)
        self.position_table = torch.nn.Embedding(32, width)
        self.register_buffer("position_ids", torch.arange(32)[None], persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(1, 32, dtype=torch.long), False)
        self.norm, self.out = torch.nn.LayerNorm(width), torch.nn.Linear(width, width)

    def forward(self, ids):
        x = self.combine(self.words(ids), self.type_table(self.types(self, ids)))
        x = x + self.position_table(self.position_ids[:, : ids.shape[1]])
        return self.out(self.norm(x))


@functools.cache
def _pair():
    return lower_xnnpack_pair(Embeddings, token_ids, TOKEN_LENGTH)


def test_the_token_types_are_one_row_static_and_dynamic_alike():
    pair = _pair()
    for lowered in (pair.static, pair.dynamic):
        by_place = {d.where: d for d in lowered.decisions if d.fold == FOLD}
        # the token lookup is the user's: nothing decided; the positions vary
        assert set(by_place) == {"embedding_1", "embedding_2"}
        assert by_place["embedding_1"].applied
        assert by_place["embedding_2"].detail.endswith("` holds more than one value")
    static_only, dynamic_only = decisions_apart(pair, lambda fold: fold == FOLD)
    assert not static_only and not dynamic_only
    # the words' lookup (the dynamic positions are the table's slice, another pass's)
    outside = pair.dynamic.program.ops_outside()
    assert "aten.gather.default" not in outside and outside[EMBEDDING] == 1, outside
    assert pair.dynamic.program.delegates() == pair.static.program.delegates() == 1
    assert_dynamic_matches_eager(pair)


def _export(module: torch.nn.Module) -> torch.export.ExportedProgram:
    return torch.export.export(
        module.eval(), token_ids(6), dynamic_shapes=TOKEN_LENGTH.dynamic_shapes()
    )


SAME_TYPES = {"zeros": _zeros, "zeros_like": _zeros_like, "new_zeros": _new_zeros}


@pytest.mark.parametrize("spelling", SAME_TYPES)
def test_the_graph_adds_a_row_constant(spelling):
    module = Embeddings(types=SAME_TYPES[spelling])
    program = _export(module)
    with collect_decisions() as decisions:
        rewritten = embeddings_of_one_index_as_rows(program)
    ops = Counter(str(n.target) for n in rewritten.graph.nodes if n.op == "call_function")
    assert ops[EMBEDDING] == 2
    assert not {"aten.zeros.default", "aten.zeros_like.default", "aten.new_zeros.default"} & set(
        ops
    )
    (row,) = [n for n in rewritten.graph.nodes if n.name.endswith("_row_0")]
    assert tuple(row.meta["val"].shape) == (1, 1, 16)
    assert torch.equal(rewritten.constants[row.target][0, 0], module.type_table.weight[0])
    assert sorted((d.where, d.applied) for d in decisions if d.fold == FOLD) == [
        ("embedding_1", True),
        ("embedding_2", False),  # the positions' buffer: judged only by etfold's entry point
    ]
    for length in (2, 17, 32):
        (ids,) = token_ids(length)
        assert torch.equal(rewritten.module()(ids), program.module()(ids))


def test_token_types_shaped_like_the_ids_lower_as_the_buffers_do():
    """`zeros_like(ids)` reads the ids' shape, never their values: the same decisions,
    delegates and ops outside as BERT's buffer, static and dynamic."""
    written = lower_xnnpack_pair(
        functools.partial(Embeddings, types=_zeros_like), token_ids, TOKEN_LENGTH
    )
    for ours, buffers in ((written.static, _pair().static), (written.dynamic, _pair().dynamic)):
        assert ours.program.delegates() == buffers.program.delegates() == 1
        assert ours.program.ops_outside() == buffers.program.ops_outside()
        applied = [d.where for d in ours.decisions if d.fold == FOLD and d.applied]
        assert applied == ["embedding_1"]
    assert_dynamic_matches_eager(written)


CASES = {
    "holds more than one value": dict(types=_positions),
    "not an add, sub or mul": dict(types=_zeros, combine=lambda w, t: w + t.sum(-1, True)),
    "holds 5, not a row of": dict(types=_fives),
    "is written in this method": dict(types=_written),
    "was not judged across methods": dict(types=_buffer_types),
}


@pytest.mark.parametrize("reason", CASES)
def test_declines_when(reason):
    program = _export(Embeddings(**CASES[reason]))
    if reason != "was not judged across methods":
        mark_for_lowering({"forward": program})  # as etfold's entry point marks its copy
    code = program.graph_module.code
    with collect_decisions() as decisions:
        assert embeddings_of_one_index_as_rows(program) is program
    assert program.graph_module.code == code
    declined = [d for d in decisions if d.fold == FOLD and d.where == "embedding_1"]
    assert [d.applied for d in declined] == [False] and reason in declined[0].detail, declined
