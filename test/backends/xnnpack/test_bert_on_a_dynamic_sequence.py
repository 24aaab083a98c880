# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""transformers' BertModel under a padding mask, exported with a dynamic sequence, gets
the delegates its static export gets; what stays outside besides is the position
table's rows read up to the sequence length, with its reason."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

from etfold.harness.dynamic_pairs import (
    LengthAxis,
    assert_dynamic_matches_eager,
    decisions_apart,
    lower_xnnpack_pair,
)
from etfold.harness.sequence_models import token_ids

OURS = {
    "xnnpack.index_by_aranges_as_view",
    "xnnpack.and_all_true_as_other_operand",
    "xnnpack.embedding_of_one_index_as_row",
    "xnnpack.attention_scores_in_bmm_shape",
    "xnnpack.attention_mask_unexpanded",
    "xnnpack.embedding_of_positions_as_table_slice",
}


class HiddenStates(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state


def _bert() -> torch.nn.Module:
    """Random weights from a config written here: 1 layer, 2 heads, width 16."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return HiddenStates(transformers.BertModel(config, add_pooling_layer=False))


def _inputs(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    (ids,) = token_ids(length)
    mask = torch.ones(1, length, dtype=torch.long)
    mask[0, length - length // 4 :] = 0
    return ids, mask


AXIS = LengthAxis(((1,), (1,)), 8, 32, 16)


@functools.cache
def _pair():
    return lower_xnnpack_pair(_bert, _inputs, AXIS)


def test_the_dynamic_export_gets_the_static_delegates():
    pair = _pair()
    assert pair.dynamic.program.delegates() == pair.static.program.delegates()
    static_only, dynamic_only = decisions_apart(pair, OURS.__contains__)
    # the static views are XNNPACK's, the static positions a folded constant: only the
    # dynamic scores need the bmm shape, and the dynamic positions the table's slice
    assert not static_only
    assert dynamic_only == Counter(
        {
            ("xnnpack.attention_scores_in_bmm_shape", True, ""): 1,  # one per layer
            ("xnnpack.embedding_of_positions_as_table_slice", True, ""): 1,
        }
    )
    assert_dynamic_matches_eager(pair)


def test_what_only_the_dynamic_export_leaves_outside_has_its_reason():
    pair = _pair()
    extra = pair.dynamic.program.ops_outside() - pair.static.program.ops_outside()
    assert extra == Counter(
        {
            "aten.slice_copy.Tensor": 1,  # the position table's rows up to the length
            "aten.sym_size.int": 1,  # the length it reads
        }
    ), extra
    reasons = Counter(d.fold for d in pair.dynamic.decisions if not d.applied)
    details = [d.detail for d in pair.dynamic.decisions if not d.applied]
    assert reasons["xnnpack.dynamic_slice"] == 1
    assert any(d.startswith("dynamic shape: slices dim 0") for d in details)
