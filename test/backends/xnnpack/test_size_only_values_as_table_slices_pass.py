# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A dynamic decoder's causal mask and rotary cos/sin, built from arange(s) on every
call, are slices of one table: the delegates a static export gets, and the same bits."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack._passes.size_only_values_as_table_slices_pass import (
    FOLD,
    size_only_values_as_table_slices,
)
from etfold.decisions import collect_decisions
from etfold.exir.program.lower import mark_for_lowering
from etfold.harness.dynamic_pairs import (
    LengthAxis,
    assert_dynamic_matches_eager,
    decisions_apart,
    lower_xnnpack_pair,
)
from etfold.harness.masked_attention import MaskedAttention, masked_inputs, masked_length
from etfold.harness.sequence_models import TOKEN_LENGTH, token_ids

SLICE = "aten.slice_copy.Tensor"
SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def _positions(s: int) -> torch.Tensor:
    return torch.arange(s).float()


def _flipped(s: int) -> torch.Tensor:
    return torch.arange(s).float().flip(0)


class RotaryCausalAttention(torch.nn.Module):
    """Token ids through one attention whose causal mask and rotary cos/sin are built
    from the length on each call, as HF decoders build them."""

    def __init__(self, width: int = 16, heads: int = 2, positions=_positions, written=False):
        super().__init__()
        self.heads, self.positions, self.written = heads, positions, written
        self.embed = torch.nn.Embedding(50, width)
        self.qkv, self.o = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        half = width // heads // 2
        inv_freq = 1.0 / 10000 ** (torch.arange(half).float() / half)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, ids):
        s, width = ids.shape[1], self.o.in_features
        if self.written:
            self.inv_freq.mul_(1.0)
        angles = self.positions(s)[:, None] * self.inv_freq[None]
        angles = torch.cat([angles, angles], -1)
        cos, sin = angles.cos()[None, None], angles.sin()[None, None]
        qkv = self.qkv(self.embed(ids)).view(1, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = (t * cos + _rotate_half(t) * sin if i < 2 else t for i, t in enumerate(qkv))
        mask = torch.arange(s)[None, :] <= torch.arange(s)[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])
        return self.o(o.transpose(1, 2).reshape(1, s, width))


@functools.cache
def _pair():
    return lower_xnnpack_pair(RotaryCausalAttention, token_ids, TOKEN_LENGTH)


def test_the_dynamic_mask_and_rotary_tables_are_one_tables_slices():
    pair = _pair()
    static_only, dynamic_only = decisions_apart(pair, lambda fold: fold == FOLD)
    # static: constant propagation folds them, nothing to decide
    assert not static_only and dynamic_only == Counter({(FOLD, True, ""): 3})
    outside = pair.dynamic.program.ops_outside()
    # the table's rows to the length, and the mask's columns: nothing else computes outside
    assert outside[SLICE] == 2, outside
    assert set(outside) <= {SLICE, "aten.sym_size.int", "aten.embedding.default"}, outside
    assert pair.dynamic.program.delegates() == pair.static.program.delegates() == 1
    assert_dynamic_matches_eager(pair)


def _export(module: torch.nn.Module, length: LengthAxis = TOKEN_LENGTH, marked: bool = True):
    program = torch.export.export(
        module.eval(), token_ids(length.traced), dynamic_shapes=length.dynamic_shapes()
    )
    if marked:
        mark_for_lowering({"forward": program})  # as etfold's entry point marks its copy
    return program


def _decomposed_outputs(program: torch.export.ExportedProgram, lengths) -> list[torch.Tensor]:
    """Outputs through the decomposition the lowering runs: attention adds the float mask
    its boolean one becomes, so the rewrite is exact there."""
    module = program.run_decompositions().module()
    return [module(*token_ids(n)) for n in lengths]


def _same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b, strict=True)
    )


def test_the_graph_reads_one_table_and_gives_the_same_bits_at_every_length():
    program = _export(RotaryCausalAttention())
    with collect_decisions() as decisions:
        rewritten = size_only_values_as_table_slices(program)
    targets = Counter(str(n.target) for n in rewritten.graph.nodes if n.op == "call_function")
    assert not {"aten.arange.start_step", "aten.arange.default", "aten.cos.default"} & set(targets)
    assert len(rewritten.constants) == len(program.constants) + 1
    applied = [d for d in decisions if d.fold == FOLD]
    assert all(d.applied for d in applied) and len(applied) == 3, applied
    assert "additive float mask" in applied[0].detail, applied
    lengths = range(TOKEN_LENGTH.low, TOKEN_LENGTH.high + 1)
    assert _same_bits(
        _decomposed_outputs(rewritten, lengths), _decomposed_outputs(program, lengths)
    )


CASES = {
    "is not the leading block of its largest value": dict(module=dict(positions=_flipped)),
    "is written in this method": dict(module=dict(written=True)),
    "was not judged across methods": dict(marked=False),
}


@pytest.mark.parametrize("reason", CASES)
def test_declines_when(reason):
    case = CASES[reason]
    program = _export(
        RotaryCausalAttention(**case.get("module", {})), marked=case.get("marked", True)
    )
    code = program.graph_module.code
    with collect_decisions() as decisions:
        size_only_values_as_table_slices(program)
    assert program.graph_module.code == code  # the program handed in is never rewritten
    declined = [d for d in decisions if d.fold == FOLD and not d.applied]
    assert any(reason in d.detail for d in declined), declined


class UserMask(RotaryCausalAttention):
    """The mask reads the token ids' values: not the sizes alone."""

    def forward(self, ids):
        s = ids.shape[1]
        qkv = self.qkv(self.embed(ids)).view(1, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        keep = (ids > 0)[:, None, None, :] & (torch.arange(s)[None, :] <= torch.arange(s)[:, None])
        o = F.scaled_dot_product_attention(*qkv, attn_mask=keep)
        return self.o(o.transpose(1, 2).reshape(1, s, -1))


def test_a_mask_of_the_users_values_is_left_to_them():
    program = _export(UserMask())
    with collect_decisions() as decisions:
        rewritten = size_only_values_as_table_slices(program)
    # only the causal part is the sizes' alone: it is tabled as it is, the user's & stays
    (applied,) = [d for d in decisions if d.fold == FOLD]
    assert applied.applied and "table of itself" in applied.detail, applied
    targets = Counter(str(n.target) for n in rewritten.graph.nodes if n.op == "call_function")
    assert targets["aten.gt.Scalar"] == 1, targets
    lengths = (TOKEN_LENGTH.low, 9, TOKEN_LENGTH.high)
    assert _same_bits(
        _decomposed_outputs(rewritten, lengths), _decomposed_outputs(program, lengths)
    )


SMALL = LengthAxis(((1,),), 2, 12, 5)
UNARY = {
    "cos": torch.cos,
    "scaled": lambda t: t * 0.37 + 1.5,
    "exp": lambda t: torch.exp(-t / 8),
    "cumsum": lambda t: torch.cumsum(t, -1),
    "flip": lambda t: t.flip(-1),
    "square": lambda t: t * t,
}


class Generated(torch.nn.Module):
    """Token ids scaled by a chain of ops on arange(s), and, for a mask, attention
    under a comparison of positions."""

    def __init__(self, chain: tuple[str, ...], compare: str | None):
        super().__init__()
        self.chain, self.compare = chain, compare
        self.embed = torch.nn.Embedding(50, 8)

    def forward(self, ids):
        s = ids.shape[1]
        value = torch.arange(s).float()
        for name in self.chain:
            value = UNARY[name](value)
        x = self.embed(ids) * value[None, :, None]
        if self.compare is None:
            return x
        i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
        mask = (j <= i) if self.compare == "causal" else (j >= i)
        q = x.view(1, s, 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask[None, None])


@settings(max_examples=4, deadline=None)
@given(
    chain=st.lists(st.sampled_from(sorted(UNARY)), min_size=1, max_size=3).map(tuple),
    compare=st.sampled_from([None, "causal", "anticausal"]),
)
def test_generated_size_only_values_keep_every_bit_or_are_declined(chain, compare):
    torch.manual_seed(0)
    program = _export(Generated(chain, compare), SMALL)
    with collect_decisions() as decisions:
        rewritten = size_only_values_as_table_slices(program)
    ours = [d for d in decisions if d.fold == FOLD]
    # a reversal's values at length s are no prefix of its values at the bound
    leading = "flip" not in chain
    assert any(d.applied for d in ours) == (leading or compare is not None), ours
    assert all(d.applied for d in ours) == leading, ours
    lengths = range(SMALL.low, SMALL.high + 1)  # the bound too: the tables keep it
    assert _same_bits(
        _decomposed_outputs(rewritten, lengths), _decomposed_outputs(program, lengths)
    )


def _masked_export(kind: str):
    module = MaskedAttention(kind).eval()
    length = masked_length(kind, "11TT")
    make = masked_inputs(kind, "11TT", 1)
    program = torch.export.export(
        module, make(length.traced), dynamic_shapes=length.dynamic_shapes()
    )
    mark_for_lowering({"forward": program})
    return program, make, length


@pytest.mark.parametrize(
    "kind",
    [
        "buffer",
        "additive",
        pytest.param("additive_buffer", marks=pytest.mark.long),
        pytest.param("finfo_min", marks=pytest.mark.long),
    ],
)
def test_an_attentions_mask_is_tabled_as_the_float_it_adds_without_its_leading_ones(kind):
    """A [1, 1, t, t] mask, boolean or float, sliced from a buffer or computed: the
    attention reads a [t, t] slice of its additive table (no conversion, no view)."""
    program, make, length = _masked_export(kind)
    with collect_decisions() as decisions:
        rewritten = size_only_values_as_table_slices(program)
    (applied,) = [d for d in decisions if d.fold == FOLD]
    assert applied.applied and "additive float mask" in applied.detail, applied
    (attention,) = [n for n in rewritten.graph.nodes if n.target is SDPA]
    assert attention.args[3].meta["val"].dim() == 2
    lengths = range(length.low, length.high + 1, 5)

    def outputs(p):
        module = p.run_decompositions().module()
        return [module(*make(n)) for n in lengths]

    assert _same_bits(outputs(rewritten), outputs(program))


class SlicedSquareMask(torch.nn.Module):
    """A float [t, t] mask sliced from a 2-D buffer: no conversion or view to save."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.full((30, 30), float("-inf")).triu(1))

    def forward(self, x):
        t = x.shape[2]
        return F.scaled_dot_product_attention(x, x, x, attn_mask=self.bias[:t, :t])


def test_a_mask_only_sliced_from_a_buffer_in_its_added_form_gets_no_table():
    length = torch.export.Dim("t", min=2, max=20)
    program = torch.export.export(
        SlicedSquareMask(), (torch.randn(1, 2, 6, 4),), dynamic_shapes=({2: length},)
    )
    mark_for_lowering({"forward": program})
    with collect_decisions() as decisions:
        assert size_only_values_as_table_slices(program) is program
    assert [d for d in decisions if d.fold == FOLD] == []
