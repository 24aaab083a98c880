# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""`is_causal=True` becomes the boolean mask it stands for, and the program computes
the same bits: decomposed, both forms are the same ops on the same values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.causal_attention_as_mask_pass import (
    FOLD,
    causal_attentions_as_masks,
)
from etfold.decisions import collect_decisions

SDPA = torch.ops.aten.scaled_dot_product_attention.default


class Causal(torch.nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)


def _inputs(heads: int, rows: int, columns: int, dtype=torch.float32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, rows, 8, generator=generator).to(dtype)
    k = torch.randn(1, heads, columns, 8, generator=generator).to(dtype)
    v = torch.randn(1, heads, columns, 8, generator=generator).to(dtype)
    return q, k, v


def _export(inputs, dynamic: bool = False, module=None):
    shapes = None
    if dynamic:
        rows, columns = torch.export.Dim("rows", max=32), torch.export.Dim("columns", max=32)
        shapes = ({2: rows}, {2: columns}, {2: columns})
    return torch.export.export((module or Causal()).eval(), inputs, dynamic_shapes=shapes)


def _rewritten(program):
    with collect_decisions() as decisions:
        rewritten = causal_attentions_as_masks(program)
    return rewritten, [(d.applied, d.detail) for d in decisions if d.fold == FOLD]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_the_attention_reads_a_lower_triangle_as_its_mask(dynamic):
    program = _export(_inputs(2, 5, 7), dynamic)
    rewritten, decisions = _rewritten(program)
    assert decisions == [(True, "is_causal as tril(ones(L, S)), its boolean mask")]
    (attention,) = [n for n in rewritten.graph.nodes if n.target is SDPA]
    mask = attention.args[3]
    assert mask.target is torch.ops.aten.tril.default
    assert attention.args[5] is False and "is_causal" not in attention.kwargs
    sizes = mask.args[0].args[0]
    if dynamic:  # the length of q and of k, read from them
        assert [s.target for s in sizes] == [torch.ops.aten.sym_size.int] * 2
        assert [s.args[0].name for s in sizes] == ["q", "k"]
    else:
        assert sizes == [5, 7]
    # the user's program is untouched
    assert [n for n in program.graph.nodes if n.target is SDPA][0].args[5] is True


def _decomposed_outputs(program, inputs):
    table = XnnpackPartitioner()._decomposition_table(program)
    return program.run_decompositions(table).module()(*inputs)


@settings(max_examples=2)
@given(
    heads=st.integers(1, 3),
    rows=st.integers(1, 9),
    columns=st.integers(1, 9),
    half=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_mask_form_computes_the_same_bits(heads, rows, columns, half, seed):
    dtype = torch.float16 if half else torch.float32
    inputs = _inputs(heads, rows, columns, dtype, seed)
    program = _export(inputs)
    rewritten, _ = _rewritten(program)
    expected = _decomposed_outputs(program, inputs)
    actual = _decomposed_outputs(rewritten, inputs)
    torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True)


def test_declines_when_the_attention_has_dropout():
    program = _export(_inputs(2, 5, 5), module=Causal(dropout=0.5))
    code = program.graph_module.code
    rewritten, decisions = _rewritten(program)
    assert rewritten is program and program.graph_module.code == code
    assert decisions == [(False, "dropout_p=0.5: the attention draws a mask per call")]
