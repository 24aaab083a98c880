# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A GEMM with a constant operand in any layout (`x @ W.T`, `matmul(x, B)`, an einsum, a
bmm of a broadcast matrix) is one XNNPACK linear, static and dynamic; Whisper-style
logits tied to the embedding join the delegate, which owns a copy of the table."""

from __future__ import annotations

import functools

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.gemm_with_constant_operand_as_linear_pass import (
    FOLD,
    gemms_with_constant_operands_as_linear,
)
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.dynamic_pairs import (
    LengthAxis,
    decisions_apart,
    dynamic_errors,
    lower_xnnpack_pair,
)
from etfold.harness.xnnpack_runner import assert_close, eager_outputs, lower_module_xnnpack

K, N = 16, 24
VOCAB = 1100  # a table past the weight fold's 64 KiB growth budget: 1100 x 16 x 4 B


class Gemms(torch.nn.Module):
    """Each layout of a constant right operand a user writes."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(N, K) / 4)
        self.register_buffer("b", torch.randn(K, N) / 4)
        self.e = torch.nn.Parameter(torch.randn(N, K) / 4)
        self.v = torch.nn.Parameter(torch.randn(N, K) / 4)
        self.m = torch.nn.Parameter(torch.randn(N, K) / 4)

    def forward(self, x):  # x: [batch, length, K]
        x = torch.relu(x)
        return (
            x @ self.w.T,
            torch.matmul(x, self.b),
            torch.einsum("btk,nk->btn", x, self.e),
            torch.bmm(x, self.v.t().expand(x.shape[0], K, N)),
            torch.mm(x[0], torch.transpose(self.m, 0, 1)),
        )


class TiedLogits(torch.nn.Module):
    """Whisper's decoder head: logits against the token embedding, after a layer norm."""

    def __init__(self):
        super().__init__()
        self.token_embedding = torch.nn.Embedding(VOCAB, K)
        self.ln = torch.nn.LayerNorm(K)

    def forward(self, ids):
        x = self.ln(self.token_embedding(ids))
        return (x @ torch.transpose(self.token_embedding.weight.to(x.dtype), 0, 1)).float()


def _x(length: int) -> tuple[torch.Tensor]:
    return (torch.randn(2, length, K, generator=torch.Generator().manual_seed(length)),)


def _ids(length: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(length)),)


@functools.cache
def _lowered(build, make_inputs, partitioner: str):
    torch.manual_seed(0)
    module, inputs = build().eval(), make_inputs(5)
    if partitioner == "stock":
        return lower_module_xnnpack(module, inputs, [UpstreamXnnpackPartitioner()]), ()
    with collect_decisions() as decisions:
        lowered = lower_module_xnnpack(
            module, inputs, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
        )
    return lowered, tuple(d for d in decisions if d.fold == FOLD)


LAYOUTS_LENGTH = LengthAxis(((1,),), 1, 24, 5)


@functools.cache
def _layouts_pair():
    return lower_xnnpack_pair(Gemms, _x, LAYOUTS_LENGTH)


def test_every_layout_is_one_linear_in_one_delegate_matching_eager_and_stock():
    pair = _layouts_pair()
    program, decisions = pair.static.program, [d for d in pair.static.decisions if d.fold == FOLD]
    (stock, _), _ = _lowered(Gemms, _x, "stock")
    assert stock.delegates() > 1
    assert program.delegates() == 1 and not program.ops_outside()
    assert [d.detail for d in decisions] == [
        f"linear over `w` itself ([{N}, {K}])",
        f"linear over a [{N}, {K}] re-layout of `b`, which it replaces: no bytes added",
        f"linear over `e` itself ([{N}, {K}])",
        f"linear over `v` itself ([{N}, {K}])",
        f"linear over `m` itself ([{N}, {K}])",
    ]
    actual = program.run(*_x(5))
    assert_close(actual, eager_outputs(pair.module, _x(5)), atol=1e-5, rtol=1e-5)
    assert_close(actual, stock.run(*_x(5)), atol=1e-5, rtol=1e-5)


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.b = torch.nn.Parameter(torch.randn(K, N))

    def forward(self, x):
        return torch.relu(x) @ self.b


def test_the_rewrite_reads_a_transposed_copy_named_from_the_weight_and_drops_it():
    torch.manual_seed(0)
    module = Plain().eval()
    program = torch.export.export(module, _x(5))
    rewritten = gemms_with_constant_operands_as_linear(program, bf16=False)
    (linear,) = [n for n in rewritten.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert "b" not in rewritten.state_dict and "p_b" not in {n.name for n in rewritten.graph.nodes}
    (copy,) = [name for name in rewritten.constants if name.startswith("_etfold_b_linear_weight")]
    assert linear.args[1].name == copy
    assert torch.equal(rewritten.constants[copy], module.b.detach().t())
    assert "b" in program.state_dict and not program.constants  # the program handed in is kept
    assert_close([rewritten.module()(*_x(5))], [module(*_x(5))], atol=1e-6)


def test_tied_logits_join_the_delegate_that_owns_a_copy_of_the_table():
    """Stock keeps the mm, the norm and the transpose outside; the weight fold would add
    a transposed table past its budget; the linear reads a copy, the bytes recorded."""
    (program, expected), decisions = _lowered(TiedLogits, _ids, "etfold")
    (stock, _), _ = _lowered(TiedLogits, _ids, "stock")
    assert "aten.mm.default" in stock.ops_outside()
    assert program.delegates() == 1 and program.ops_outside() == {"aten.embedding.default": 1}
    (decision,) = decisions
    table_bytes = VOCAB * K * 4
    assert decision.detail.endswith(
        f"which embedding also read: the delegate owns its copy, {table_bytes} B added"
    )
    assert table_bytes <= program.pte_bytes - stock.pte_bytes <= table_bytes + 4096
    actual = program.run(*_ids(5))
    assert_close(actual, expected, atol=2e-5, rtol=1e-5)
    assert_close(actual, stock.run(*_ids(5)), atol=2e-5, rtol=1e-5)


def _assert_one_linear_at_every_bound(pair, count: int) -> None:
    assert decisions_apart(pair, lambda fold: fold == FOLD) == ({}, {})
    assert len([d for d in pair.dynamic.decisions if d.fold == FOLD and d.applied]) == count
    static, dynamic = pair.static.program, pair.dynamic.program
    assert static.delegates() == dynamic.delegates() == 1
    assert static.ops_outside() == dynamic.ops_outside()  # no size arithmetic, no views
    errors = dynamic_errors(pair)
    assert set(errors) >= {pair.length.low, pair.length.high} and len(errors) == 4
    assert max(errors.values()) <= 2e-5


def test_a_dynamic_length_is_one_linear_in_every_layout_as_the_static_one_at_every_bound():
    _assert_one_linear_at_every_bound(_layouts_pair(), 5)


@pytest.mark.long
def test_dynamic_tied_logits_are_one_linear_as_the_static_ones_at_every_bound():
    pair = lower_xnnpack_pair(TiedLogits, _ids, LengthAxis(((1,),), 1, 16, 5))
    _assert_one_linear_at_every_bound(pair, 1)


@pytest.mark.long
def test_a_dynamic_batch_broadcast_by_bmm_is_one_linear_at_every_bound():
    class Batched(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.v = torch.nn.Parameter(torch.randn(N, K) / 4)

        def forward(self, x):
            return torch.bmm(torch.relu(x), self.v.t().unsqueeze(0).expand(x.shape[0], K, N))

    def batch(length: int) -> tuple[torch.Tensor]:
        return (torch.randn(length, 3, K, generator=torch.Generator().manual_seed(length)),)

    pair = lower_xnnpack_pair(Batched, batch, LengthAxis(((0,),), 1, 8, 3))
    assert decisions_apart(pair, lambda fold: fold == FOLD) == ({}, {})
    assert pair.dynamic.program.delegates() == 1 and not pair.dynamic.program.ops_outside()
    assert max(dynamic_errors(pair).values()) <= 1e-5


def _declined_by_pass(module, inputs) -> list[str]:
    """The pass on the exported program: it must come back unchanged; the reasons."""
    program = torch.export.export(module.eval(), inputs)
    before = program.graph_module.code
    with collect_decisions() as decisions:
        result = gemms_with_constant_operands_as_linear(program, bf16=False)
    assert result is program and program.graph_module.code == before
    return [d.detail for d in decisions if d.fold == FOLD and not d.applied]


class Logits(torch.nn.Module):
    def __init__(self, transform=lambda x: x):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(N, K))
        self.transform = transform

    def forward(self, x):
        return self.transform(x) @ self.w.T


def test_declines_when_the_constant_is_written_by_the_program():
    class Accumulated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.randn(K, N))

        def forward(self, x):
            y = x @ self.b
            self.b.add_(1.0)
            return y

    (reason,) = _declined_by_pass(Accumulated(), (torch.randn(3, K),))
    assert "`b` is written in this method" in reason


def test_declines_when_xnnpack_cannot_compile_its_dtype():
    (reason,) = _declined_by_pass(Logits().double(), (torch.randn(3, K).double(),))
    assert reason.startswith("torch.float64 linear")


def test_declines_when_xnnpack_cannot_hold_its_rank():
    (reason,) = _declined_by_pass(Logits(), (torch.randn(1, 1, 1, 1, 1, 2, 3, K),))
    assert reason == "rank 8 input: XNNPACK holds at most 6 dims"


def test_declines_when_the_input_is_quantized():
    def dequantized(q):
        return torch.ops.quantized_decomposed.dequantize_per_tensor(
            q, 0.1, 0, -128, 127, torch.int8
        )

    inputs = (torch.randint(-128, 127, (3, K), dtype=torch.int8),)
    (reason,) = _declined_by_pass(Logits(dequantized), inputs)
    assert reason.startswith("quantized input")


def test_a_gemm_of_runtime_values_a_constant_on_the_left_or_constants_is_not_judged():
    """Two runtime values, a constant on the left, or constants alone (an adapter's
    `a @ b`: constant work, the weight fold's): left as they came, nothing declined."""

    class NotOurs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(K, K))
            self.a, self.b = (
                torch.nn.Parameter(torch.randn(K, 2)),
                torch.nn.Parameter(torch.randn(2, K)),
            )

        def forward(self, x, y):
            return x @ y.T, self.w @ x.T, torch.nn.functional.linear(x, self.a @ self.b)

    assert _declined_by_pass(NotOurs(), (torch.randn(3, K), torch.randn(4, K))) == []


@pytest.mark.long
@settings(max_examples=4)
@given(
    form=st.sampled_from(["T", "t", "transpose", "plain", "einsum_kn", "permute"]),
    leading=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    dtype=st.sampled_from([torch.float32, torch.float16]),
)
def test_generated_gemms_are_one_linear_matching_eager_and_stock(form, leading, dtype):
    weights = {
        "T": lambda w: w.T,
        "t": lambda w: w.t(),
        "transpose": lambda w: torch.transpose(w, 0, 1),
        "permute": lambda w: w.permute(1, 0),
        "plain": lambda w: w.T.contiguous().T.T,  # a [K, N] layout reached by copies
    }

    class Generated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(N, K) / 4)

        def forward(self, x):
            x = torch.relu(x)
            if form == "einsum_kn":
                return torch.einsum("...k,kn->...n", x, self.w.T)
            return torch.matmul(x, weights[form](self.w))

    torch.manual_seed(0)
    module = Generated().to(dtype).eval()
    inputs = (torch.randn(*leading, 5, K, generator=torch.Generator().manual_seed(1)).to(dtype),)
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(
            module, inputs, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
        )
    stock, _ = lower_module_xnnpack(module, inputs, [UpstreamXnnpackPartitioner()])
    assert [d.applied for d in decisions if d.fold == FOLD] == [True]
    assert program.delegates() == 1 and not program.ops_outside()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert_close(program.run(*inputs), expected, atol=tolerance, rtol=tolerance)
    assert_close(program.run(*inputs), stock.run(*inputs), atol=tolerance, rtol=tolerance)
