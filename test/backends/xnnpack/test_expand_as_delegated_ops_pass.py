# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Grouped-query attention's repeat_kv and a broadcast causal mask run inside the delegate."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.expand_as_delegated_ops_pass import (
    BROADCASTING_OPS,
    FOLD,
    expands_as_delegated_ops,
)
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.dynamic_shapes import check_at_sizes, lower_dynamic
from etfold.harness.xnnpack_runner import assert_close, lower_module_xnnpack

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """As HF Llama, SmolLM and Gemma write it."""
    b, kv_heads, t, d = x.shape
    x = x[:, :, None, :, :].expand(b, kv_heads, n_rep, t, d)
    return x.reshape(b, kv_heads * n_rep, t, d)


class Gqa(torch.nn.Module):
    """Eager attention with 6 query heads over 2 KV heads and a [1, 1, T, T] causal mask."""

    def __init__(self, dim=24, heads=6, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k = torch.nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = torch.nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o = torch.nn.Linear(heads * self.head_dim, dim, bias=False)

    def _split(self, x, heads):
        b, t, _ = x.shape
        return x.view(b, t, heads, self.head_dim).transpose(1, 2)

    def forward(self, x, mask):
        b, t, _ = x.shape
        n_rep = self.heads // self.kv_heads
        q = self._split(self.q(x), self.heads)
        k = repeat_kv(self._split(self.k(x), self.kv_heads), n_rep)
        v = repeat_kv(self._split(self.v(x), self.kv_heads), n_rep)
        scores = q @ k.transpose(2, 3) * self.head_dim**-0.5
        scores = scores + mask.expand(b, self.heads, t, t)
        weights = torch.softmax(scores, dim=-1)
        return self.o((weights @ v).transpose(1, 2).reshape(b, t, -1))


def _causal_mask(t, dtype):
    return torch.triu(torch.full((t, t), float("-inf")), 1)[None, None].to(dtype)


def _lower(module, inputs, *, bf16=False, upstream_entry_point=False):
    lower = {} if upstream_entry_point else {"lower": to_edge_transform_and_lower}
    partitioner = XnnpackPartitioner(enable_bf16=True) if bf16 else XnnpackPartitioner()
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(module, inputs, [partitioner], **lower)
    return program, expected, [d for d in decisions if d.fold == FOLD]


@functools.cache
def _lowered_gqa(dtype, upstream_entry_point):
    torch.manual_seed(0)
    module = Gqa().to(dtype).eval()
    inputs = (torch.randn(2, 5, 24).to(dtype), _causal_mask(5, dtype))
    bf16 = dtype is torch.bfloat16
    lowered = _lower(module, inputs, bf16=bf16, upstream_entry_point=upstream_entry_point)
    return (*lowered, inputs)


GQA_DETAILS = [
    "3 copies along axis 2",  # repeat_kv of k
    "3 copies along axis 2",  # repeat_kv of v
    "a no-op: its input is read instead",  # q @ k^T batches q
    "a no-op: its input is read instead",  # ... and k^T
    "dropped: add broadcast its input",  # the [1, 1, T, T] mask
    "a no-op: its input is read instead",  # weights @ v batches the weights
    "a no-op: its input is read instead",  # ... and v
]
# measured: stock ExecuTorch 1.5.1 leaves 7 expand_copy and 2 unsqueeze_copy outside 4 delegates


# Through upstream's entry point in `make test-long`: both entry points run the one
# pre-decomposition hook and decide alike (test_entry_point_pairs, in `make test`)
@pytest.mark.parametrize(
    ("dtype", "upstream_entry_point", "delegates", "outside"),
    [
        (torch.float32, False, 1, {}),
        # the attention scale is a half constant, no runtime convert (the number-operand fold)
        (torch.float16, False, 1, {}),
        # XNNPACK in executorch 1.5.1 compiles no bf16 bmm: the two are widened to fp32
        (torch.bfloat16, False, 1, {}),
        pytest.param(torch.float32, True, 1, {}, marks=pytest.mark.long),
    ],
    ids=["fp32", "fp16", "bf16", "fp32-upstream_entry_point"],
)
def test_gqa_attention_leaves_no_expand_outside(dtype, upstream_entry_point, delegates, outside):
    program, _, decisions, _ = _lowered_gqa(dtype, upstream_entry_point)
    assert program.delegates() == delegates and program.ops_outside() == outside
    assert [(d.applied, d.detail) for d in decisions] == [(True, d) for d in GQA_DETAILS]


@pytest.mark.parametrize(
    ("dtype", "atol"),
    [(torch.float32, 1e-5), (torch.float16, 4e-3), (torch.bfloat16, 3e-2)],
    ids=["fp32", "fp16", "bf16"],
)
def test_gqa_attention_on_the_runtime_matches_eager(dtype, atol):
    """The expands only copy; the GEMMs differ from eager's in summation order only
    (outputs of magnitude below 0.5: atol a few units in the dtype's last place)."""
    program, expected, _, inputs = _lowered_gqa(dtype, False)
    assert_close(program.run(*inputs), expected, atol=atol)


class RepeatAndMask(torch.nn.Module):
    """Only copies and exact elementwise ops: the runtime equals eager bit for bit."""

    def __init__(self, n_rep=3):
        super().__init__()
        self.n_rep = n_rep

    def forward(self, k, scores, mask):
        b, h, t, _ = scores.shape
        return repeat_kv(k + k, self.n_rep), scores + mask.expand(b, h, t, t)


@pytest.mark.parametrize("n_rep", [3, 7], ids=["one-cat", "chained-cats"])
def test_repeat_kv_and_mask_are_bit_exact(n_rep):
    gen = torch.Generator().manual_seed(n_rep)
    k, scores = (
        torch.randn(2, 2, 5, 4, generator=gen),
        torch.randn(2, 2 * n_rep, 5, 5, generator=gen),
    )
    inputs = (k, scores, _causal_mask(5, torch.float32))
    program, expected, decisions = _lower(RepeatAndMask(n_rep), inputs)
    assert program.delegates() == 1 and not program.ops_outside()
    assert [d.detail for d in decisions] == [
        f"{n_rep} copies along axis 2",
        "dropped: add_1 broadcast its input",
    ]
    actual = program.run(*inputs)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))


class Generated(torch.nn.Module):
    """`x` expanded to `shape` twice: read by an add (dropped) and by a reshape (copies)."""

    def __init__(self, shape):
        super().__init__()
        self.shape = shape

    def forward(self, x, y):
        return x.expand(self.shape) + y, (x * 2).expand(self.shape).reshape(-1)


@settings(max_examples=2)
@given(
    shape=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    repeats=st.lists(st.integers(2, 7), min_size=1, max_size=2),
    leading=st.booleans(),
    dtype=st.sampled_from(DTYPES),
)
def test_generated_expands_join_the_delegate_bit_for_bit(shape, repeats, leading, dtype):
    source = list(shape)
    out = list(shape)
    for i, n in enumerate(repeats):
        source[i], out[i] = 1, n
    out = [2, *out] if leading else out
    gen = torch.Generator().manual_seed(len(out))
    inputs = tuple(torch.randn(s, generator=gen).to(dtype) for s in (source, out))
    program, expected, decisions = _lower(Generated(out), inputs, bf16=dtype is torch.bfloat16)
    assert "aten.expand_copy.default" not in program.ops_outside()
    assert len(decisions) == 2 and all(d.applied for d in decisions)
    actual = program.run(*inputs)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))


# ---- dynamic shapes: the sequence dim is a torch.export.Dim, the copies are static


@functools.cache
def _lowered_dynamic_gqa():
    torch.manual_seed(0)
    tokens = torch.export.Dim("tokens", min=2, max=16)
    example = (torch.randn(1, 5, 24), _causal_mask(5, torch.float32))
    dims = ({1: tokens}, {2: tokens, 3: tokens})
    module = Gqa().eval()
    program, decisions = lower_dynamic(
        module, example, dims, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
    )
    return module, program, [d for d in decisions if d.fold == FOLD]


def test_dynamic_gqa_rewrites_every_expand_as_the_static_export_does():
    """Only the node names differ (the dynamic program is decomposed in another order)."""
    _, program, decisions = _lowered_dynamic_gqa()
    details = [(d.applied, re.sub(r"add_\d+", "add", d.detail)) for d in decisions]
    assert details == [(True, detail) for detail in GQA_DETAILS]
    assert "aten.expand_copy.default" not in program.ops_outside()


@pytest.mark.parametrize("tokens", [2, 9, 16], ids=["min", "between", "max"])
def test_dynamic_gqa_on_the_runtime_matches_eager_within_the_bounds(tokens):
    module, program, _ = _lowered_dynamic_gqa()
    check_at_sizes(
        program,
        module,
        lambda t: (torch.randn(1, t, 24), _causal_mask(t, torch.float32)),
        [tokens],
        atol=1e-5,
    )


@settings(max_examples=2, deadline=None, phases=[Phase.generate])
@given(
    rows=st.integers(2, 6),
    n_rep=st.integers(2, 7),
    leading=st.booleans(),
)
def test_generated_dynamic_repeats_are_bit_exact_at_the_bounds(rows, n_rep, leading):
    """`x` of [rows, 1, T] (T dynamic) copied n_rep times along axis 1, with and without a
    new leading axis; run at T's minimum and maximum."""
    shape = [2, rows, n_rep, -1] if leading else [rows, n_rep, -1]

    class Repeat(torch.nn.Module):
        def forward(self, x):
            out = list(shape)
            out[-1] = x.shape[-1]
            return (x + x).expand(out).reshape(-1, x.shape[-1])

    length = torch.export.Dim("length", min=3, max=12)
    module = Repeat()
    program, decisions = lower_dynamic(
        module, (torch.randn(rows, 1, 5),), ({2: length},), [XnnpackPartitioner()]
    )
    assert [d.applied for d in decisions if d.fold == FOLD] == [True]
    assert program.delegates() == 1 and not program.ops_outside()
    for t in (3, 12):
        x = torch.randn(rows, 1, t)
        (actual,) = program.run(x)
        assert torch.equal(actual, module(x))


class MaskedScores(torch.nn.Module):
    """A padding mask [B, 1, 1, T] expanded along a dynamic T, then added: dropped."""

    def forward(self, scores, mask):
        b, h, t, _ = scores.shape
        return scores + mask.expand(b, 1, t, t)


def test_an_expand_along_a_dynamic_dim_is_dropped_before_a_broadcasting_op():
    tokens = torch.export.Dim("tokens", min=2, max=24)
    example = (torch.randn(1, 2, 5, 5), torch.randn(1, 1, 1, 5))
    program, decisions = lower_dynamic(
        MaskedScores(),
        example,
        ({2: tokens, 3: tokens}, {3: tokens}),
        [XnnpackPartitioner()],
        lower=to_edge_transform_and_lower,
    )
    details = [re.sub(r"add_\d+", "add", d.detail) for d in decisions if d.fold == FOLD]
    assert details == ["dropped: add broadcast its input"]
    assert program.delegates() == 1 and not program.ops_outside()
    for t in (2, 24):
        inputs = (torch.randn(1, 2, t, t), torch.randn(1, 1, 1, t))
        (actual,) = program.run(*inputs)
        assert torch.equal(actual, MaskedScores()(*inputs))


class RotaryTable(torch.nn.Module):
    """HF Llama's rotary table: `cat((freqs, freqs), -1)` of a product over the positions."""

    def forward(self, positions):
        freqs = positions * 0.5
        return torch.cat((freqs, freqs), dim=-1) + 1.0


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_cat_of_one_input_is_written_as_copies(dynamic):
    tokens = torch.export.Dim("tokens", min=2, max=40)
    dims = ({1: tokens},) if dynamic else None
    program, decisions = lower_dynamic(
        RotaryTable(),
        (torch.randn(1, 7, 16),),
        dims,
        [XnnpackPartitioner()],
        lower=to_edge_transform_and_lower,
    )
    assert [d.detail for d in decisions if d.fold == FOLD] == ["one input, 2 copies along axis 2"]
    assert program.delegates() == 1 and not program.ops_outside()
    for t in (2, 40) if dynamic else (7,):
        x = torch.randn(1, t, 16)
        (actual,) = program.run(x)
        assert torch.equal(actual, RotaryTable()(x))


# ---- declines: the program comes back as it was, the reason recorded

ALL_BROADCASTING = tuple(BROADCASTING_OPS)


def _declined(module, inputs, *, bf16=False, **export_kwargs) -> list[str]:
    program = torch.export.export(module, inputs, **export_kwargs)
    with collect_decisions() as decisions:
        assert expands_as_delegated_ops(program, None, ALL_BROADCASTING, bf16=bf16) is program
    return [d.detail for d in decisions if d.fold == FOLD and not d.applied]


class Copies(torch.nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.shape = shape

    def forward(self, x):
        return x.expand(self.shape).reshape(-1)


def test_declines_when_the_number_of_copies_is_symbolic():
    rows = torch.export.Dim("rows", min=2, max=8)

    class CopiesPerRow(torch.nn.Module):
        def forward(self, x, y):
            return x.expand(y.shape[0], 4).reshape(-1), y

    inputs = (torch.randn(1, 4), torch.randn(3, 4))
    (reason,) = _declined(CopiesPerRow(), inputs, dynamic_shapes=(None, {0: rows}))
    assert re.fullmatch(
        r"dynamic shape: dim 0 goes from 1 to (s\d+) \(\1 in 2\.\.8\): "
        r"the copies are not known when lowering",
        reason,
    )


def test_declines_copies_of_an_input_with_two_symbolic_sizes():
    """The first copy beside the input is a view: XNNPACK's reshape infers one size."""
    rows, cols = torch.export.Dim("rows", min=2, max=8), torch.export.Dim("cols", min=2, max=8)

    class Repeated(torch.nn.Module):
        def forward(self, x):
            return x.expand(x.shape[0], 3, x.shape[2]).reshape(-1)

    dims = ({0: rows, 2: cols},)
    (reason,) = _declined(Repeated(), (torch.randn(2, 1, 4),), dynamic_shapes=dims)
    assert re.fullmatch(
        r"the copied input has symbolic sizes at dim 0 \(s\d+ in 2\.\.8\), "
        r"dim 2 \(s\d+ in 2\.\.8\): XNNPACK's static reshape infers at most one",
        reason,
    )


def test_declines_when_the_result_is_empty():
    reasons = _declined(Copies([0, 3, 4]), (torch.randn(0, 1, 4),))
    assert reasons == ["empty result [0, 3, 4]: XNNPACK takes no empty tensors"]


def test_declines_when_the_rank_exceeds_xnnpacks():
    reasons = _declined(Copies([1, 1, 1, 1, 1, 3, 2]), (torch.randn(1, 2),))
    assert reasons == ["rank 7 result: XNNPACK holds at most 6 dims"]


def test_declines_integer_copies():
    reasons = _declined(Copies([3, 4]), (torch.arange(4).reshape(1, 4),))
    assert reasons == ["torch.int64 copy along an axis: XNNPACK takes float16/float32 for it here"]


def test_declines_bf16_copies_where_bf16_is_not_enabled():
    reasons = _declined(Copies([3, 4]), (torch.randn(1, 4).bfloat16(),))
    assert reasons == [
        "torch.bfloat16 copy along an axis: XNNPACK takes float16/float32 for it here"
    ]


def test_declines_an_integer_cat_of_one_input():
    class Ids(torch.nn.Module):
        def forward(self, ids):
            return torch.cat((ids, ids), 0) * 2

    reasons = _declined(Ids(), (torch.arange(4),))
    assert reasons == ["torch.int64 copy along an axis: XNNPACK takes float16/float32 for it here"]


def test_declines_a_returned_no_op():
    class Returned(torch.nn.Module):
        def forward(self, x):
            return x.expand(2, 4)

    reasons = _declined(Returned(), (torch.randn(2, 4),))
    assert reasons == ["a no-op the program returns: removed, it would return its input"]


def test_declines_a_quantized_input():
    from torch.ao.quantization.fx import _decomposed  # noqa: F401  (registers the q/dq ops)

    class Dequantized(torch.nn.Module):
        def forward(self, codes):
            x = torch.ops.quantized_decomposed.dequantize_per_tensor(
                codes, 0.1, 0, -128, 127, torch.int8
            )
            return x.expand(3, 4) + 1.0

    reasons = _declined(Dequantized(), (torch.randint(-128, 128, (1, 4), dtype=torch.int8),))
    assert reasons == ["quantized input: the copies would each need quantization"]


def test_an_expand_that_sets_the_shape_alone_is_copied_not_dropped():
    """`mul(e, 2.0)`: without the expand the product would keep x's shape."""

    class Scaled(torch.nn.Module):
        def forward(self, x):
            return x.expand(3, 4) * 2.0

    program = torch.export.export(Scaled(), (torch.randn(1, 4),))
    with collect_decisions() as decisions:
        rewritten = expands_as_delegated_ops(program, None, ALL_BROADCASTING, bf16=False)
    assert [d.detail for d in decisions if d.fold == FOLD] == ["3 copies along axis 0"]
    targets = [n.target for n in rewritten.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.expand.default not in targets
    assert targets.count(torch.ops.aten.cat.default) == 1
    x = torch.randn(1, 4)
    assert torch.equal(rewritten.module()(x), Scaled()(x))


class MaskedAttentionCall(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_an_attentions_expands_are_seen_in_its_decomposition():
    """SDPA's decomposition batches q, k and v with expands of their own shape (no-ops):
    the program is decomposed first, so they go (the attention holds no batched
    `matmul` for `_makes_expands` to find before decomposition)."""
    q = torch.randn(1, 2, 5, 4)
    inputs = (q, q.clone(), q.clone(), torch.zeros(1, 1, 5, 5))
    program = torch.export.export(MaskedAttentionCall(), inputs)
    table = XnnpackPartitioner()._decomposition_table(program)
    with collect_decisions() as decisions:
        rewritten = expands_as_delegated_ops(program, table, ALL_BROADCASTING, bf16=False)
    applied = [d.detail for d in decisions if d.fold == FOLD and d.applied]
    assert applied and set(applied) == {"a no-op: its input is read instead"}
    assert torch.ops.aten.expand.default not in {n.target for n in rewritten.graph.nodes}
    torch.testing.assert_close(rewritten.module()(*inputs), program.module()(*inputs))
