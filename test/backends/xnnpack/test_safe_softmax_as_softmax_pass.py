# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""SDPA's fully-masked-row guard leaves the graph where no row can be fully masked,
so attention stays in one delegate; where a row may be, the guard stays and says why."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.safe_softmax_as_softmax_pass import (
    FOLD,
    safe_softmaxes_as_softmax,
)
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.demo_lowerings import lowered_demo
from etfold.harness.dynamic_pairs import (
    LengthAxis,
    decisions_apart,
    dynamic_errors,
    lower_static_and_dynamic,
)
from etfold.harness.xnnpack_runner import (
    assert_close,
    eager_outputs,
    lower_module_xnnpack,
    max_abs_error,
)

# the decoder rows are `lowered_demo`'s, shared with the other files of this group
pytestmark = pytest.mark.xdist_group("demo_lowerings")

# the guard's ops but its where, which a causal mask's construction also writes
GUARD_OPS = {
    "aten.eq.Scalar",
    "aten.logical_not.default",
    "aten.any.dim",
    "aten.full_like.default",
}
WHERE = "aten.where.self"


def _guard_ops_outside(program) -> set[str]:
    return GUARD_OPS & set(program.ops_outside())


def _ours(decisions) -> list[tuple[bool, str]]:
    return [(d.applied, d.detail) for d in decisions if d.fold == FOLD]


# ---- a Llama decoder with SmolLM2's attention (SDPA, a causal mask built from constants)


@functools.cache
def _llama_through_upstream(dtype):
    from etfold.demo_models.mixed_precision_decoders import tiny_llama, token_ids

    bf16 = dtype is torch.bfloat16
    partitioner = XnnpackPartitioner(enable_bf16=True) if bf16 else XnnpackPartitioner()
    inputs = (token_ids(),)
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(tiny_llama(dtype, layers=2), inputs, [partitioner])
    return program, inputs, expected, tuple(decisions)


def _llama(dtype, upstream_entry_point):
    pytest.importorskip("transformers")
    if upstream_entry_point:
        return _llama_through_upstream(dtype)
    lowering = lowered_demo("llama_tiny_bf16", fp32_twin=dtype is torch.float32)
    return lowering.program, lowering.inputs, lowering.expected, lowering.decisions


# The bf16 decoder through etfold's entry point in `make test` (the fp32 encoder attention
# below covers the pass in fp32; test_entry_point_pairs, that upstream's entry point decides
# as etfold's); the fp32 decoder and upstream's entry point, each another decoder lowering,
# in `make test-long`.
# measured before this pass: the guard's six ops per layer stay outside, between 4
# delegates; without them the two layers lower as 2 (the embedding and the final alias
# stay outside)
DECODER_DELEGATES = 2


@pytest.mark.parametrize(
    ("dtype", "upstream_entry_point", "atol"),
    [
        pytest.param(torch.float32, False, 1e-4, marks=pytest.mark.long),
        (torch.bfloat16, False, 2e-2),
        pytest.param(torch.float32, True, 1e-4, marks=pytest.mark.long),
        pytest.param(torch.bfloat16, True, 2e-2, marks=pytest.mark.long),
    ],
    ids=["fp32", "bf16", "fp32-upstream_entry_point", "bf16-upstream_entry_point"],
)
def test_decoder_attention_leaves_no_guard_outside(dtype, upstream_entry_point, atol):
    program, inputs, expected, decisions = _llama(dtype, upstream_entry_point)
    assert _guard_ops_outside(program) == set() and WHERE not in program.ops_outside()
    assert program.delegates() == DECODER_DELEGATES
    assert [applied for applied, _ in _ours(decisions)] == [True, True]  # one per layer
    outputs = [o.float() for o in program.run(*inputs)]
    assert max_abs_error(outputs, [e.float() for e in expected]) <= atol


# ---- encoder-style attention: SDPA with no mask, causal, or a mask


class Attention(torch.nn.Module):
    """A pre-norm encoder's attention: layer norm, one projection to q, k, v, SDPA, an
    output projection. The mask is a constant (or a buffer) when given here, else the
    forward's second input when called with one."""

    def __init__(self, dim=16, heads=2, *, causal=False, mask=None, buffer=False):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.o = torch.nn.Linear(dim, dim)
        if buffer:
            self.register_buffer("mask", mask)
        else:
            self.mask = mask

    def forward(self, x, mask=None):
        b, t, d = x.shape
        qkv = (
            self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        )
        mask = self.mask if mask is None else mask
        y = F.scaled_dot_product_attention(*qkv, attn_mask=mask, is_causal=self.causal)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


def _tokens(dtype=torch.float32, t=5, seed=0):
    return torch.randn(1, t, 16, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _lower(module, inputs):
    torch.manual_seed(0)
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(
            module, inputs, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
        )
    return program, expected, _ours(decisions)


def _attention(dtype, causal, mask=None, buffer=False):
    torch.manual_seed(0)
    return Attention(causal=causal, mask=mask, buffer=buffer).to(dtype).eval()


# Each dtype and each mask form once in `make test`; the other two pairings in `make test-long`.
@pytest.mark.parametrize(
    ("dtype", "causal", "atol"),
    [
        pytest.param(torch.float32, False, 1e-5, id="fp32"),
        pytest.param(torch.float32, True, 1e-5, id="fp32-causal", marks=pytest.mark.long),
        pytest.param(torch.float16, False, 4e-3, id="fp16", marks=pytest.mark.long),
        pytest.param(torch.float16, True, 4e-3, id="fp16-causal"),
    ],
)
def test_encoder_attention_is_one_delegate_and_matches_eager(dtype, causal, atol):
    inputs = (_tokens(dtype),)
    if dtype is torch.float32:  # the static half of the dynamic-length pair below
        pair = _length_pair(causal)
        program, decisions = pair.static.program, _ours(pair.static.decisions)
        expected = eager_outputs(pair.module, inputs)
    else:
        program, expected, decisions = _lower(_attention(dtype, causal), inputs)
    # is_causal's mask is folded to a constant: nothing is left outside
    assert program.delegates() == 1 and not program.ops_outside()
    detail = "every row of the constant mask" if causal else "no mask: the scores are bmm's"
    assert len(decisions) == 1 and decisions[0][0] and decisions[0][1].startswith(detail)
    assert_close(program.run(*inputs), expected, atol=atol)


# ---- declines: the guard stays, the reason recorded (the guard then reads its rows from
# the mask, `safe_softmax_guard_from_mask`: a row test on the mask, not on the scores)


def test_declines_when_the_mask_is_a_user_input():
    inputs = (_tokens(), torch.ones(5, 5, dtype=torch.bool).tril())
    program, expected, decisions = _lower(_attention(torch.float32, False), inputs)
    assert _guard_ops_outside(program) == {"aten.any.dim"}  # on the [5, 5] mask
    assert decisions == [
        (False, "the mask comes from user input mask: a row may be fully masked at runtime")
    ]
    assert_close(program.run(*inputs), expected, atol=1e-5)


def _with_a_fully_masked_row(row: int) -> torch.Tensor:
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    mask[row] = False
    return mask


def test_declines_when_a_constant_mask_row_is_fully_masked_and_keeps_eagers_zeros():
    inputs = (_tokens(),)
    module = _attention(torch.float32, False, _with_a_fully_masked_row(2))
    program, expected, decisions = _lower(module, inputs)
    # the row test of a constant mask is computed when lowering
    assert _guard_ops_outside(program) == set() and program.delegates() == 1
    assert decisions == [
        (
            False,
            "row (0, 0, 2) of the constant mask is fully masked: the guard's zeros are needed",
        )
    ]
    (actual,) = program.run(*inputs)
    # the masked token attends to nothing: its output is the output projection's bias
    assert torch.equal(expected[0][0, 2], module.o.bias.detach())
    assert_close([actual], expected, atol=1e-5)


def _declined(module, inputs, **export_kwargs) -> list[str]:
    """The pass alone, outside a lowering: it must hand the program back as it was."""
    program = torch.export.export(module, inputs, **export_kwargs)
    table = XnnpackPartitioner()._decomposition_table(program)
    code = program.graph_module.code
    with collect_decisions() as decisions:
        assert safe_softmaxes_as_softmax(program, table) is program
    assert program.graph_module.code == code
    return [detail for applied, detail in _ours(decisions) if not applied]


def test_declines_a_mask_buffer_no_lowering_judged_across_methods():
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    module = _attention(torch.float32, False, mask, buffer=True)
    assert _declined(module, (_tokens(),)) == [
        "the mask is not known when lowering: buffer `mask` was not judged across methods "
        "(lower through etfold.exir.to_edge_transform_and_lower to fold buffers)"
    ]


def test_declines_when_the_mask_cannot_be_computed_when_lowering():
    class RandomMask(Attention):
        def forward(self, x):
            return super().forward(x, torch.randn(x.shape[1], x.shape[1]))

    torch.manual_seed(0)
    assert _declined(RandomMask(), (_tokens(),)) == [
        "the mask randn could not be computed when lowering"
    ]


class SafeSoftmax(torch.nn.Module):
    """`_safe_softmax` as SDPA's decomposition calls it, of whatever `scores` gives."""

    def __init__(self, scores):
        super().__init__()
        self.scores = scores

    def forward(self, q, k):
        return torch.ops.aten._safe_softmax(self.scores(q, k), -1) * 2.0


def test_declines_when_the_scores_are_not_a_matmuls():
    module = SafeSoftmax(lambda q, k: q - k)
    inputs = (torch.randn(2, 4, 4), torch.randn(2, 4, 4))
    assert _declined(module, inputs) == [
        "the softmax reads sub, neither a matmul's scores nor scores + a mask"
    ]


# ---- a dynamic sequence: the mask, built from the length, checked at every length


def _tokens_of(length: int) -> tuple[torch.Tensor]:
    return (_tokens(t=length, seed=length),)


@functools.cache
def _length_pair(causal: bool):
    """The fp32 encoder attention traced at 5 tokens, lowered static and with 2..16 tokens."""
    axis = LengthAxis(((1,),), 2, 16, 5)
    module = _attention(torch.float32, causal)
    return lower_static_and_dynamic(module, _tokens_of, axis, lambda: [XnnpackPartitioner()])


@pytest.mark.parametrize(
    ("causal", "detail"),
    [
        (False, "no mask: the scores are bmm's"),
        (True, "keeps an entry at each of its 15 sizes"),
    ],
    ids=["no-mask", "causal"],
)
def test_a_dynamic_length_drops_the_guard_as_the_static_one_does(causal, detail):
    pair = _length_pair(causal)
    axis = pair.length
    ((applied, found),) = _ours(pair.dynamic.decisions)
    assert applied and found.endswith(detail), found
    static_only, dynamic_only = decisions_apart(pair, lambda fold: fold == FOLD)
    if not causal:  # the static mask is a constant, the dynamic one a function of the length
        assert static_only == dynamic_only == {}
    # the guard is gone; a dynamic mask is computed outside, from the length
    assert _guard_ops_outside(pair.dynamic.program) == set()
    assert pair.static.program.delegates() == pair.dynamic.program.delegates() == 1
    errors = dynamic_errors(pair)
    assert {axis.low, axis.high} <= set(errors) and max(errors.values()) <= 1e-5, errors


class SeesKeysBeforeTheLastFour(torch.nn.Module):
    """Each query sees the keys before the last four: none at all up to length 4."""

    def forward(self, q, k):
        length = q.shape[1]
        hidden = (torch.arange(length) >= length - 4).expand(length, length)
        mask = torch.where(hidden, float("-inf"), 0.0)
        return torch.ops.aten._safe_softmax(q @ k.transpose(1, 2) + mask, -1) * 2.0


def test_declines_when_the_mask_fully_masks_a_row_at_one_length():
    tokens = torch.export.Dim("tokens", min=2, max=8)
    inputs = (torch.randn(1, 5, 4), torch.randn(1, 5, 4))
    reasons = _declined(
        SeesKeysBeforeTheLastFour(), inputs, dynamic_shapes=({1: tokens}, {1: tokens})
    )
    assert len(reasons) == 1 and reasons[0].startswith("row (0, 0) of the constant mask")
    assert reasons[0].endswith("= 2")  # the first length checked: the lower bound


class LengthOfAnActivation(torch.nn.Module):
    """A causal mask built from the length of an activation (queries and keys pooled in
    pairs), which export reads off that activation: its size, never its values (a
    wav2vec2 mask reads its feature projection's)."""

    def forward(self, q, k):
        q, k = (torch.nn.functional.avg_pool1d(t.transpose(1, 2), 2) for t in (q, k))
        length = q.shape[2]
        hidden = torch.arange(length) > torch.arange(length)[:, None]
        mask = torch.where(hidden, float("-inf"), 0.0)
        scores = q.transpose(1, 2) @ k + mask
        return torch.ops.aten._safe_softmax(scores, -1) * 2.0


def test_a_mask_reading_an_activations_length_drops_the_guard_at_every_length():
    tokens = torch.export.Dim("tokens", min=2, max=8)
    inputs = (torch.randn(1, 10, 4), torch.randn(1, 10, 4))
    program = torch.export.export(
        LengthOfAnActivation(), inputs, dynamic_shapes=({1: 2 * tokens}, {1: 2 * tokens})
    )
    (size,) = program.graph.find_nodes(op="call_function", target=torch.ops.aten.sym_size.int)
    assert (
        size.args[0].target is not torch.ops.aten.sym_size.int and size.args[0].op != "placeholder"
    )
    table = XnnpackPartitioner()._decomposition_table(program)
    with collect_decisions() as decisions:
        rewritten = safe_softmaxes_as_softmax(program, table)
    assert _ours(decisions) == [
        (True, "every row of the mask `where` keeps an entry at each of its 7 sizes")
    ]
    for length in (2, 5, 8):
        q, k = torch.randn(1, 2 * length, 4), torch.randn(1, 2 * length, 4)
        torch.testing.assert_close(rewritten.module()(q, k), LengthOfAnActivation()(q, k))


def test_declines_when_the_lengths_are_too_many_to_check():
    tokens = torch.export.Dim("tokens", min=2, max=8192)
    reasons = _declined(
        _attention(torch.float32, True), (_tokens(t=5),), dynamic_shapes=({1: tokens},)
    )
    assert reasons[0].startswith("dynamic shape: dim 1 of `x` (")
    assert reasons[0].endswith("in 2..8192): 8191 sizes, over 4096 to check")


def test_declines_when_the_program_returns_the_guarded_softmax():
    class Returned(torch.nn.Module):
        def forward(self, q, k):
            return torch.ops.aten._safe_softmax(q @ k.transpose(1, 2), -1)

    inputs = (torch.randn(2, 4, 4), torch.randn(2, 4, 4))
    assert _declined(Returned(), inputs) == [
        "the program returns the guarded softmax: its output would be renamed"
    ]


# ---- generated constant masks: rewritten exactly when every row keeps an entry


# derandomized, the two masks drawn are all False (declined) and one whose every row keeps
# an entry (rewritten); the hand-written tests above hold both outcomes too
@settings(max_examples=2, deadline=None)
@given(
    rows=st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=4, max_size=4),
)
def test_generated_constant_masks_drop_the_guard_iff_every_row_keeps_an_entry(rows):
    mask = torch.tensor(rows, dtype=torch.bool)
    inputs = (_tokens(t=4, seed=1),)
    program, expected, decisions = _lower(_attention(torch.float32, False, mask), inputs)
    every_row_kept = bool(mask.any(-1).all())
    assert [applied for applied, _ in decisions] == [every_row_kept]
    # a kept guard reads its rows from the constant mask, computed when lowering
    assert _guard_ops_outside(program) == set() and program.delegates() == 1
    assert_close(program.run(*inputs), expected, atol=1e-5)
