# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Half-precision ops without an accurate kernel are computed in fp32 between two converts."""

from __future__ import annotations

import copy
import functools
from collections import Counter

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from executorch.exir import to_edge_transform_and_lower as upstream_lower
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.widen_half_precision_ops_pass import (
    FOLD,
    match_half_precision_op,
    widen_half_precision_ops,
)
from etfold.decisions import Declined, collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.demo_lowerings import lowered_demo
from etfold.harness.dynamic_shapes import lower_dynamic
from etfold.harness.xnnpack_runner import eager_outputs, lower_xnnpack, max_abs_error

aten = torch.ops.aten
TO_COPY = aten._to_copy.default
F = torch.nn.functional


class HalfOp(torch.nn.Module):
    """One op of the table on `x`; `norm` holds layer_norm's weight and bias."""

    def __init__(self, op: str, width: int):
        super().__init__()
        self.op = op
        self.norm = torch.nn.LayerNorm(width)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        if self.op == "layer_norm":
            return self.norm(x)
        if self.op == "var":
            return x.var(-1, keepdim=True)
        if self.op == "softmax":
            return torch.softmax(4 * x, -1)
        if self.op == "cumsum":
            return torch.cumsum(x, -1)
        if self.op == "gelu":
            return F.gelu(4 * x)
        raise ValueError(self.op)


OP_TARGETS = {
    "layer_norm": aten.layer_norm.default,
    "var": aten.var.dim,
    "softmax": aten.softmax.int,
    "cumsum": aten.cumsum.default,
    "gelu": aten.gelu.default,
}


def _case(op: str, dtype: torch.dtype, width: int, offset: float = 0.5, seed: int = 0):
    """The half module, its input, and the fp32 eager reference on the same values."""
    torch.manual_seed(seed)
    half = HalfOp(op, width).eval().to(dtype)
    x = (torch.randn(4, width) + offset).to(dtype)
    # the same half weights and input, computed in fp32
    return half, (x,), eager_outputs(copy.deepcopy(half).float(), (x.float(),))


def _lower(module, inputs, partitioner, lower=to_edge_transform_and_lower):
    return lower_xnnpack(torch.export.export(module, inputs), [partitioner], lower=lower)


def _error(actual, expected) -> float:
    return max_abs_error([a.float() for a in actual], expected)


def _ulp_error(expected, dtype) -> float:
    """What rounding the fp32 result to `dtype` alone costs."""
    return _error([e.to(dtype) for e in expected], expected)


# (op, dtype, width): every op in both half dtypes it is widened in, widths 256-1024
ACCURACY_CASES = [
    ("layer_norm", torch.float16, 384),
    ("layer_norm", torch.bfloat16, 1024),
    ("var", torch.float16, 1024),
    ("var", torch.bfloat16, 512),
    ("softmax", torch.float16, 1024),
    ("softmax", torch.bfloat16, 512),
    ("cumsum", torch.float16, 1024),
    ("cumsum", torch.bfloat16, 256),
    ("gelu", torch.float16, 768),
]


@functools.cache
def _widened(op: str, dtype: torch.dtype, width: int):
    """`_case` lowered with etfold, its decisions, and the user's exported program with
    its code and node metadata from before the lowering."""
    module, inputs, expected = _case(op, dtype, width)
    program = torch.export.export(module, inputs)
    code, nodes = program.graph_module.code, [dict(n.meta) for n in program.graph.nodes]
    with collect_decisions() as decisions:
        lowered = lower_xnnpack(program, [XnnpackPartitioner()], lower=to_edge_transform_and_lower)
    return inputs, expected, lowered, tuple(decisions), (program, code, nodes)


@pytest.mark.parametrize("op,dtype,width", ACCURACY_CASES)
def test_widened_op_on_the_runtime_matches_fp32_eager_within_one_rounding(op, dtype, width):
    inputs, expected, lowered, decisions, _ = _widened(op, dtype, width)
    assert [d.where for d in decisions if d.fold == FOLD and d.applied] == [op]
    assert _error(lowered.run(*inputs), expected) <= 1.01 * _ulp_error(expected, dtype)


# what the widening fixes, for each op in one half dtype in `make test` (fp16 for layer_norm
# and var, bf16 for cumsum), in the other in `make test-long`
STOCK_SHOWN_SHORT = {
    ("layer_norm", torch.float16),
    ("var", torch.float16),
    ("cumsum", torch.bfloat16),
}


@pytest.mark.parametrize(
    "op,dtype,width",
    [
        pytest.param(*c, marks=[] if c[:2] in STOCK_SHOWN_SHORT else [pytest.mark.long])
        for c in ACCURACY_CASES
        if c[0] in ("layer_norm", "var", "cumsum")
    ],
)
def test_stock_lowering_of_the_same_op_is_far_off(op, dtype, width):
    """What the widening fixes: the portable half kernel, stock ExecuTorch."""
    module, inputs, expected = _case(op, dtype, width)
    stock = _lower(module, inputs, UpstreamXnnpackPartitioner(enable_bf16=True), upstream_lower)
    assert _error(stock.run(*inputs), expected) > 3 * _ulp_error(expected, dtype)


# derandomized, the two norms drawn are fp16 at width 256 and bf16 at 878 (a third was bf16 again)
@settings(max_examples=2, deadline=None)
@given(
    width=st.integers(256, 1024),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    offset=st.floats(-2.0, 2.0),
    seed=st.integers(0, 2**16),
)
def test_generated_layer_norms_match_fp32_eager(width, dtype, offset, seed):
    module, inputs, expected = _case("layer_norm", dtype, width, offset, seed)
    lowered = _lower(module, inputs, XnnpackPartitioner())
    assert _error(lowered.run(*inputs), expected) <= 1.01 * _ulp_error(expected, dtype)


def _targets(program) -> Counter:
    return Counter(n.target for n in program.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("op", list(OP_TARGETS))
def test_the_graph_computes_the_op_in_fp32_between_two_converts(op):
    module, inputs, _ = _case(op, torch.float16, 256)
    users_program = torch.export.export(module, inputs)
    before = _targets(users_program)[TO_COPY]
    program = widen_half_precision_ops(users_program)
    assert program is not users_program and _targets(users_program)[TO_COPY] == before
    (node,) = [n for n in program.graph.nodes if n.target is OP_TARGETS[op]]
    assert node.meta["val"].dtype is torch.float32
    assert node.args[0].target is TO_COPY and node.args[0].kwargs["dtype"] is torch.float32
    (narrowed,) = node.users
    assert narrowed.target is TO_COPY and narrowed.kwargs["dtype"] is torch.float16
    widened_weights = 2 if op == "layer_norm" else 0
    assert _targets(program)[TO_COPY] == before + 2 + widened_weights


@pytest.mark.parametrize("op", ["gelu", "layer_norm"])
def test_lowering_leaves_the_users_program_as_it_was(op):
    # the accuracy test's lowering of the op in fp16 (its width does not matter here)
    (width,) = [w for o, d, w in ACCURACY_CASES if (o, d) == (op, torch.float16)]
    *_, decisions, (program, code, nodes) = _widened(op, torch.float16, width)
    assert any(d.fold == FOLD and d.applied for d in decisions)
    assert program.graph_module.code == code
    after = [n.meta.get("val") for n in program.graph.nodes]
    assert len(after) == len(nodes) and all(
        value is meta.get("val") for value, meta in zip(after, nodes, strict=True)
    )


def test_fp16_gelu_widened_is_fp32_gelu_rounded_once():
    """The identity the widening promises: GELU computed in fp32 on the fp16 operand,
    rounded once to fp16. Eager's own fp16 GELU and torch's fp32 GELU both differ by CPU
    (an AVX2 fp32 GELU is several fp16 ulps off in the far negative tail, where the values
    are below 1e-5), so against eager the check is torch's fp16 tolerance."""
    module, inputs, _ = _case("gelu", torch.float16, 256)
    program = widen_half_precision_ops(torch.export.export(module, inputs))
    (x,) = inputs
    operand = 4 * x  # the module's own fp16 product, before the GELU
    rounded_once = F.gelu(operand.float()).half()
    widened = program.module()(*inputs)
    assert widened.dtype == torch.float16
    assert torch.equal(widened, rounded_once)
    torch.testing.assert_close(widened, eager_outputs(module, inputs)[0])


@pytest.mark.parametrize(
    "op,dtype",
    [("gelu", torch.bfloat16), ("layer_norm", torch.float32), ("cumsum", torch.float32)],
)
def test_ops_outside_their_widened_dtypes_are_left_alone(op, dtype):
    module, inputs, _ = _case(op, dtype, 256)
    program = torch.export.export(module, inputs)
    before = str(program.graph)
    with collect_decisions() as decisions:
        widen_half_precision_ops(program)
    assert str(program.graph) == before and not decisions


def _assert_declined(program, reason: str):
    before = str(program.graph)
    with collect_decisions() as decisions:
        widen_half_precision_ops(program)
    assert str(program.graph) == before
    assert [d.detail for d in decisions if d.fold == FOLD] == [reason]


def test_declines_when_a_tensor_argument_has_no_metadata():
    module, inputs, _ = _case("layer_norm", torch.float16, 256)
    program = torch.export.export(module, inputs)
    (node,) = [n for n in program.graph.nodes if n.target is aten.layer_norm.default]
    del node.args[2].meta["val"]
    reason = "the op or one of its tensor arguments has no tensor metadata"
    assert match_half_precision_op(node) == Declined(reason)
    _assert_declined(program, reason)


def test_declines_when_the_op_already_returns_another_dtype():
    class CumsumToFp64(torch.nn.Module):
        def forward(self, x):
            return torch.cumsum(x, -1, dtype=torch.float64)

    x = torch.randn(2, 256).half()
    program = torch.export.export(CumsumToFp64(), (x,))
    _assert_declined(program, "the op already returns torch.float64, not its input's torch.float16")


def test_an_op_asked_to_compute_in_fp32_is_left_alone_silently():
    class SoftmaxInFp32(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x, -1, dtype=torch.float32)

    program = torch.export.export(SoftmaxInFp32(), (torch.randn(2, 256).half(),))
    before = str(program.graph)
    with collect_decisions() as decisions:
        widen_half_precision_ops(program)
    assert str(program.graph) == before and not decisions


def test_declines_when_a_tensor_argument_is_neither_half_nor_fp32():
    module, inputs, _ = _case("layer_norm", torch.float16, 256)
    program = torch.export.export(module, inputs)
    (node,) = [n for n in program.graph.nodes if n.target is aten.layer_norm.default]
    weight = node.args[2]
    weight.meta["val"] = weight.meta["val"].to(torch.float64)
    _assert_declined(program, "a tensor argument is neither torch.float16 nor float32")


def test_with_delegated_converts_off_nothing_is_widened():
    module, inputs, _ = _case("gelu", torch.float16, 256)
    with collect_decisions() as decisions:
        lowered = _lower(module, inputs, XnnpackPartitioner(delegate_dtype_converts=False))
    assert not [d for d in decisions if d.fold == FOLD]
    assert lowered.ops_outside()["aten.gelu.default"] == 1


def test_fp16_encoder_at_hidden_384_matches_fp32_eager_where_stock_gives_nan():
    from etfold.demo_models.half_precision_regions import tiny_encoder, token_ids

    encoder, ids = tiny_encoder(torch.float16), token_ids()
    expected = eager_outputs(copy.deepcopy(encoder).float(), (ids,))
    eager_half_error = _error(eager_outputs(encoder, (ids,)), expected)
    etfold = lowered_demo("encoder_fp16_layer_norm").program  # this model, as the report lowers it
    stock = lower_xnnpack(torch.export.export(encoder, (ids,)), [UpstreamXnnpackPartitioner()])
    assert stock.run(ids)[0].isnan().any()
    (output,) = etfold.run(ids)
    assert not output.isnan().any() and etfold.ops_outside()["aten.gelu.default"] == 0
    # XNNPACK's fp16 GEMMs round differently from eager's: within twice eager's own fp16 error
    assert _error([output], expected) <= 2 * eager_half_error


class AttentionBlock(torch.nn.Module):
    """A Llama-style pre-norm attention block written out: RMSNorm's mean of x^2, then
    `softmax(q @ k^T) @ v`, all in the module's dtype."""

    def __init__(self, width: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm_weight = torch.nn.Parameter(torch.rand(width) + 0.5)
        self.qkv = torch.nn.Linear(width, 3 * width, bias=False)
        self.out = torch.nn.Linear(width, width, bias=False)

    def forward(self, x):
        batch, length, width = x.shape
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        q, k, v = (
            t.view(batch, length, self.heads, -1).transpose(1, 2)
            for t in self.qkv(h).split(width, -1)
        )
        scores = q @ k.transpose(-2, -1) / (width // self.heads) ** 0.5
        context = torch.softmax(scores, -1) @ v
        return x + self.out(context.transpose(1, 2).reshape(batch, length, width))


@functools.cache
def _bf16_attention_block():
    """The block in bf16 lowered with bf16 enabled, its input, eager bf16 and fp32 outputs."""
    torch.manual_seed(0)
    block = AttentionBlock().eval().to(torch.bfloat16)
    inputs = (torch.randn(1, 8, 64).to(torch.bfloat16),)
    fp32 = eager_outputs(copy.deepcopy(block).float(), (inputs[0].float(),))
    with collect_decisions() as decisions:
        lowered = _lower(block, inputs, XnnpackPartitioner(enable_bf16=True))
    eager = [e.float() for e in eager_outputs(block, inputs)]
    return lowered, inputs, eager, fp32, tuple(decisions)


def test_bf16_attention_and_rms_norm_lower_as_one_delegate_close_to_eager():
    lowered, inputs, eager, fp32, decisions = _bf16_attention_block()
    widened = [d.where for d in decisions if d.fold == FOLD and d.applied]
    assert sorted(widened) == ["matmul", "matmul_1", "mean", "softmax"]
    outside = lowered.ops_outside()
    assert lowered.delegates() == 1
    assert outside["aten.bmm.default"] == 0 and outside["aten.mean.dim"] == 0
    output = lowered.run(*inputs)
    # XNNPACK's bf16 GEMMs accumulate in another order than eager's, which may flip the
    # rounding of the final bf16 residual add: one bf16 ulp at the output's magnitude
    ulp = 2.0 ** (torch.floor(torch.log2(eager[0].abs().max())).item() - 7)
    assert _error(output, eager) <= ulp
    assert _error(output, fp32) <= _error(eager, fp32)


class ConvStem(torch.nn.Module):
    """A ViT's patch embedding (conv2d, stride = kernel), a linear over the patches, and an
    audio encoder's conv1d over them: in bf16, each conv splits the delegate unwidened."""

    def __init__(self):
        super().__init__()
        self.patches = torch.nn.Conv2d(3, 32, 8, stride=8)
        self.linear = torch.nn.Linear(32, 32)
        self.conv1d = torch.nn.Conv1d(32, 32, 3, padding=1)

    def forward(self, x):
        tokens = self.linear(self.patches(x).flatten(2).transpose(1, 2))
        return self.conv1d(tokens.transpose(1, 2))


def test_bf16_convolutions_lower_inside_the_delegate_no_further_from_fp32_than_eager():
    torch.manual_seed(0)
    module = ConvStem().to(torch.bfloat16).eval()
    x = torch.randn(1, 3, 32, 32).to(torch.bfloat16)
    fp32 = eager_outputs(copy.deepcopy(module).float(), (x.float(),))
    with collect_decisions() as decisions:
        lowered = _lower(module, (x,), XnnpackPartitioner(enable_bf16=True))
    widened = sorted(d.where for d in decisions if d.fold == FOLD and d.applied)
    assert widened == ["conv1d", "conv2d"]
    assert lowered.delegates() == 1 and sum(lowered.ops_outside().values()) == 0
    (output,) = lowered.run(x)
    assert output.dtype == torch.bfloat16
    assert _error([output], fp32) <= _error(eager_outputs(module, (x,)), fp32)


@pytest.mark.parametrize(
    "dtype,shapes",
    [
        (torch.bfloat16, [(2, 8, 64), (64, 32)]),  # folds into an mm, which runs in bf16
        (torch.float16, [(1, 4, 8, 16), (1, 4, 16, 8)]),  # XNNPACK's fp16 bmm compiles
    ],
)
def test_matmuls_with_a_kernel_in_their_dtype_are_left_alone(dtype, shapes):
    class MatMul(torch.nn.Module):
        def forward(self, a, b):
            return a @ b

    inputs = tuple(torch.randn(shape).to(dtype) for shape in shapes)
    program = torch.export.export(MatMul(), inputs)
    before = str(program.graph)
    with collect_decisions() as decisions:
        assert widen_half_precision_ops(program) is program
    assert str(program.graph) == before and not decisions


# ---- dynamic shapes: the rows are a torch.export.Dim; the widening reads no size


@functools.cache
def _widened_dynamic(op: str, dtype: torch.dtype, width: int):
    module, inputs, _ = _case(op, dtype, width)
    rows = torch.export.Dim("rows", min=2, max=24)
    lowered, decisions = lower_dynamic(
        module, inputs, ({0: rows},), [XnnpackPartitioner()], lower=to_edge_transform_and_lower
    )
    return module, lowered, decisions


@pytest.mark.parametrize(
    "op,dtype,width", [("gelu", torch.float16, 768), ("softmax", torch.bfloat16, 512)]
)
def test_a_dynamic_export_is_widened_as_the_static_one(op, dtype, width):
    _, _, _, static_decisions, _ = _widened(op, dtype, width)
    _, lowered, decisions = _widened_dynamic(op, dtype, width)
    assert [(d.where, d.detail) for d in decisions if d.fold == FOLD] == [
        (d.where, d.detail) for d in static_decisions if d.fold == FOLD
    ]
    assert not lowered.constant_work_outside()


@pytest.mark.parametrize("rows", [2, 24], ids=["min", "max"])
@pytest.mark.parametrize(
    "op,dtype,width", [("gelu", torch.float16, 768), ("softmax", torch.bfloat16, 512)]
)
def test_dynamic_widened_ops_match_fp32_eager_at_the_bounds(op, dtype, width, rows):
    module, lowered, _ = _widened_dynamic(op, dtype, width)
    x = (torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)) + 0.5).to(dtype)
    expected = eager_outputs(copy.deepcopy(module).float(), (x.float(),))
    assert _error(lowered.run(x), expected) <= 1.01 * _ulp_error(expected, dtype)
