# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A layer norm over the last dim runs inside the delegate, as row-mean GEMVs and
elementwise ops."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.layer_norm_as_delegated_ops_pass import (
    FOLD,
    layer_norms_as_delegated_ops,
)
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
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
    lower_xnnpack,
)

aten = torch.ops.aten
NORM_OPS = ("aten.native_layer_norm.default", "aten.layer_norm.default")


class NormBetween(torch.nn.Module):
    """relu -> layer norm -> doubled: the ops around the norm are exact in every dtype,
    so the runtime differs from eager by the norm alone; stock splits the delegate."""

    def __init__(self, width: int = 32, affine: bool = True, bias: bool = True):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width, elementwise_affine=affine, bias=bias)
        if affine:
            with torch.no_grad():
                self.norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
                if bias:
                    self.norm.bias.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(2))

    def forward(self, x):
        y = self.norm(torch.relu(x))
        return y + y


def _inputs(shape, dtype=torch.float32, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype),)


def _lower(module, inputs, upstream_entry_point=False):
    lower = {} if upstream_entry_point else {"lower": to_edge_transform_and_lower}
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(module, inputs, [XnnpackPartitioner()], **lower)
    return program, expected, [d for d in decisions if d.fold == FOLD]


@functools.cache
def _lowered(dtype, upstream_entry_point):
    module, inputs = NormBetween().to(dtype).eval(), _inputs((3, 5, 32), dtype)
    return (*_lower(module, inputs, upstream_entry_point), module, inputs)


def _within_one_ulp(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Each value equals eager's or one of its two neighbours in the output dtype."""
    down, up = (torch.full_like(expected, bound) for bound in (-torch.inf, torch.inf))
    neighbours = (torch.nextafter(expected, down), expected, torch.nextafter(expected, up))
    return bool(torch.stack([actual == n for n in neighbours]).any(0).all())


# Through upstream's entry point in `make test-long`: both entry points run the one
# pre-decomposition hook and decide alike (test_entry_point_pairs, in `make test`)
@pytest.mark.parametrize(
    ("dtype", "upstream_entry_point"),
    [
        (torch.float32, False),
        (torch.float16, False),
        (torch.bfloat16, False),
        pytest.param(torch.float32, True, marks=pytest.mark.long),
    ],
    ids=["fp32", "fp16", "bf16", "fp32-upstream_entry_point"],
)
def test_the_norm_joins_the_one_delegate(dtype, upstream_entry_point):
    program, _, decisions, *_ = _lowered(dtype, upstream_entry_point)
    assert program.delegates() == 1 and not program.ops_outside()
    assert [(d.applied, d.detail) for d in decisions] == [(True, "over 32 values, with affine")]


def test_fp32_on_the_runtime_matches_eager():
    """Both compute the two row means in fp32, the runtime as dot products with a column
    of 1/C: they differ in summation order and that one rounding (measured 2.4e-6 at
    width 1024, outputs of magnitude up to 6)."""
    program, expected, _, _, inputs = _lowered(torch.float32, False)
    assert_close(program.run(*inputs), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_norms_are_computed_in_fp32_and_rounded_once(dtype):
    """The half norm arrives widened to fp32: the runtime's result is the fp32 norm
    rounded once, as eager's is, so within one ulp of eager in its dtype and within one
    rounding (plus fp32 summation noise) of eager computed in fp32."""
    program, expected, _, module, inputs = _lowered(dtype, False)
    (actual,) = program.run(*inputs)
    assert actual.dtype == dtype and _within_one_ulp(actual, expected[0])
    (in_fp32,) = eager_outputs(copy.deepcopy(module).float(), tuple(x.float() for x in inputs))
    rounding = (in_fp32.to(dtype).float() - in_fp32).abs()
    assert bool(((actual.float() - in_fp32).abs() <= rounding + 1e-5).all())


class ConvThenNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3)

    def forward(self, x):
        return torch.nn.functional.layer_norm(self.conv(x), [6])


def test_a_conv_output_normalized_over_its_width_matches_eager():
    """Inside the delegate the conv's output is NHWC while the program normalizes W: the
    rewritten means and their broadcasts must still read W (upstream's layout pass)."""
    torch.manual_seed(3)
    module, inputs = ConvThenNorm().eval(), _inputs((1, 3, 5, 8))
    program, expected, decisions = _lower(module, inputs)
    assert [d.applied for d in decisions] == [True]
    assert program.delegates() == 1 and not program.ops_outside()
    assert_close(program.run(*inputs), expected, atol=1e-5, rtol=1e-5)


class NormOfNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.LayerNorm(16), torch.nn.LayerNorm(16)
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.linear(self.second(self.first(x)))


def test_a_norm_of_a_norm_is_rewritten_twice_and_matches_eager():
    """The second norm reads the first one's output, which the first rewrite replaces: each
    rewrite reads the graph the one before left (stock lowers this; etfold once failed)."""
    torch.manual_seed(4)
    module, inputs = NormOfNorm().eval(), _inputs((2, 5, 16))
    program, expected, decisions = _lower(module, inputs)
    assert [d.applied for d in decisions] == [True, True]
    assert program.delegates() == 1 and not program.ops_outside()
    assert_close(program.run(*inputs), expected, atol=1e-5, rtol=1e-5)


def _declined(
    module, inputs, *, bf16=False, edit=None, pooled_means=True, **export_kwargs
) -> list[str]:
    """The pass on the exported program: it comes back unchanged; the reasons."""
    program = torch.export.export(module.eval(), inputs, **export_kwargs)
    if edit is not None:
        edit(program)
    before = program.graph_module.code
    with collect_decisions() as decisions:
        result = layer_norms_as_delegated_ops(program, bf16=bf16, pooled_means=pooled_means)
    assert result is program and program.graph_module.code == before
    return [d.detail for d in decisions if d.fold == FOLD and not d.applied]


class FunctionalNorm(torch.nn.Module):
    def __init__(self, dims: int = 1):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, x.shape[-self.dims :])


class NativeNormWithStatistics(torch.nn.Module):
    def forward(self, x):
        out, mean, rstd = aten.native_layer_norm(x, [x.shape[-1]], None, None, 1e-5)
        return out * rstd + mean


class DequantizedNorm(torch.nn.Module):
    def forward(self, codes):
        x = torch.ops.quantized_decomposed.dequantize_per_tensor(
            codes, 0.1, 0, -128, 127, torch.int8
        )
        return torch.nn.functional.layer_norm(x, [8])


def _weight_in_float64(program):
    (norm,) = [n for n in program.graph.nodes if n.target is aten.layer_norm.default]
    norm.args[2].meta["val"] = norm.args[2].meta["val"].to(torch.float64)


def test_declines_when_it_normalizes_more_than_the_last_dim():
    (reason,) = _declined(FunctionalNorm(dims=2), _inputs((2, 3, 4)))
    assert reason.startswith("normalizes over the last dims [3, 4]")


def test_declines_when_its_mean_or_rstd_is_used():
    (reason,) = _declined(NativeNormWithStatistics(), _inputs((2, 8)))
    assert reason.startswith("its mean or rstd output is used")


def test_declines_when_the_input_is_quantized():
    from torch.ao.quantization.fx import _decomposed  # noqa: F401  (registers the q/dq ops)

    codes = torch.randint(-128, 128, (2, 8), dtype=torch.int8)
    (reason,) = _declined(DequantizedNorm(), (codes,))
    assert reason.startswith("quantized input")


def test_declines_when_xnnpack_cannot_compile_its_dtype():
    (reason,) = _declined(FunctionalNorm(), _inputs((2, 8), torch.bfloat16))
    assert reason == "torch.bfloat16 layer norm: XNNPACK takes float16/float32 for it here"


def test_an_fp16_norm_computed_in_fp16_is_far_closer_than_the_portable_kernel():
    """Converts not delegated, the norm is computed in fp16 inside the delegate:
    within a few fp16 roundings of eager fp32, where stock's portable fp16 layer
    norm is units off (measured 4.5-5.7 at width 1024)."""
    module, inputs = NormBetween(width=256).half().eval(), _inputs((4, 256), torch.float16)
    (in_fp32,) = eager_outputs(copy.deepcopy(module).float(), (inputs[0].float(),))
    errors = {}
    for name, partitioner in (
        ("stock", UpstreamXnnpackPartitioner()),
        ("etfold", XnnpackPartitioner(delegate_dtype_converts=False)),
    ):
        program, _ = lower_module_xnnpack(module, inputs, [partitioner])
        (actual,) = program.run(*inputs)
        errors[name] = float((actual.float() - in_fp32).abs().max())
    # a few fp16 roundings of outputs up to ~8 (one ulp there is 7.8e-3)
    assert errors["etfold"] <= 0.04 and errors["stock"] > 100 * errors["etfold"], errors


def test_a_bf16_norm_computed_in_bf16_joins_the_delegate_within_eagers_error():
    """With bf16 enabled the GEMVs and elementwise ops all compile in bf16 (the GEMVs
    sum in fp32): no further from eager fp32 than eager bf16 is, give or take one ulp."""
    module = torch.nn.Sequential(torch.nn.Linear(32, 32), NormBetween(width=32))
    module, inputs = module.bfloat16().eval(), _inputs((4, 32), torch.bfloat16)
    partitioner = XnnpackPartitioner(delegate_dtype_converts=False, enable_bf16=True)
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(module, inputs, [partitioner])
    assert [d.applied for d in decisions if d.fold == FOLD] == [True]
    assert program.delegates() == 1 and not program.ops_outside()
    (in_fp32,) = eager_outputs(copy.deepcopy(module).float(), (inputs[0].float(),))
    (actual,) = program.run(*inputs)
    eager_error = float((expected[0].float() - in_fp32).abs().max())
    assert float((actual.float() - in_fp32).abs().max()) <= eager_error + 2**-6


def test_declines_when_weight_and_input_dtypes_differ():
    module = NormBetween(width=8)
    (reason,) = _declined(module, _inputs((2, 8)), edit=_weight_in_float64)
    assert reason == "weight in torch.float64, input in torch.float32"


def test_declines_when_the_rank_is_beyond_xnnpack():
    (reason,) = _declined(FunctionalNorm(), _inputs((1,) * 6 + (4,)))
    assert reason.startswith("rank 7 input")


def test_two_dynamic_dims_are_rewritten_and_match_eager_across_their_bounds():
    """The row means are GEMVs: any leading dims are rows, two symbolic ones included."""
    rows, cols = torch.export.Dim("rows", min=2, max=64), torch.export.Dim("cols", min=2, max=8)
    module = NormBetween(width=8).eval()
    exported = torch.export.export(module, _inputs((4, 3, 8)), dynamic_shapes=({0: rows, 1: cols},))
    with collect_decisions() as decisions:
        program = lower_xnnpack(
            exported,
            [XnnpackPartitioner()],
            lower=to_edge_transform_and_lower,
            keep_declared_bounds=True,
        )
    assert [d.applied for d in decisions if d.fold == FOLD] == [True]
    assert program.delegates() == 1 and not program.ops_outside()
    for shape in ((2, 2, 8), (4, 3, 8), (64, 8, 8), (17, 5, 8)):
        inputs = _inputs(shape, seed=shape[0])
        assert_close(program.run(*inputs), eager_outputs(module, inputs), atol=1e-5, rtol=1e-5)


def test_a_symbolic_width_takes_pooled_means_or_declines_without_their_configs():
    """No constant holds 1/C for a symbolic C: the means stay `mean.dim` (the mean pass
    writes them as pooling) where the partitioner takes that, else the norm stays."""
    width = torch.export.Dim("width", min=2, max=32)
    inputs, shapes = _inputs((3, 8)), ({1: width},)
    program = torch.export.export(FunctionalNorm().eval(), inputs, dynamic_shapes=shapes)
    with collect_decisions() as decisions:
        rewritten = layer_norms_as_delegated_ops(program, bf16=False)
    (decision,) = [d for d in decisions if d.fold == FOLD]
    assert decision.applied and decision.detail.startswith("over a symbolic width")
    targets = [n.target for n in rewritten.graph.nodes if n.op == "call_function"]
    assert targets.count(aten.mean.dim) == 2 and aten.linear.default not in targets
    for shape in ((3, 2), (3, 32), (3, 7)):
        x = _inputs(shape, seed=shape[1])
        expected = FunctionalNorm()(*x)
        torch.testing.assert_close(rewritten.module()(*x), expected, atol=1e-5, rtol=1e-5)
    (reason,) = _declined(FunctionalNorm(), inputs, dynamic_shapes=shapes, pooled_means=False)
    assert reason == "symbolic width: its means need the mean.dim and view_copy configs"


def test_each_row_mean_reads_a_column_of_its_own():
    """Two norms, two GEMVs each: four [1, 16] columns of 1/16, none shared, so no
    constant is read by two delegates (which neither lowered module could own)."""
    program = torch.export.export(NormOfNorm().eval(), _inputs((2, 5, 16)))
    rewritten = layer_norms_as_delegated_ops(program, bf16=False)
    added = set(rewritten.constants) - set(program.constants)
    assert len(added) == 4
    for name in added:
        assert torch.equal(rewritten.constants[name], torch.full((1, 16), 1 / 16))
    weights = [n.args[1].target for n in rewritten.graph.nodes if n.target is aten.linear.default]
    expected = [*(name.replace(".", "_") for name in added), "p_linear_weight"]
    assert sorted(weights) == sorted(expected)


def test_declines_when_the_input_is_empty():
    (reason,) = _declined(FunctionalNorm(), _inputs((0, 8)))
    assert reason.startswith("empty input")


class ChannelNormBetweenConvs(torch.nn.Module):
    """wav2vec2's feature extractor: each conv's channels normalized through a transpose."""

    def __init__(self, channels: int = 16):
        super().__init__()
        self.first = torch.nn.Conv1d(1, channels, 10, stride=5)
        self.norm = torch.nn.LayerNorm(channels)
        self.second = torch.nn.Conv1d(channels, channels, 3, stride=2)

    def forward(self, x):
        y = self.norm(self.first(x).transpose(-2, -1)).transpose(-2, -1)
        return self.second(torch.nn.functional.gelu(y))


def test_a_norm_over_transposed_channels_joins_the_delegate():
    """The GEMVs read the transpose's rows as they are; Edge's permute_copy lays it out."""
    torch.manual_seed(4)
    module, inputs = ChannelNormBetweenConvs().eval(), _inputs((1, 1, 400))
    program, expected, decisions = _lower(module, inputs)
    assert [(d.applied, d.detail) for d in decisions] == [(True, "over 16 values, with affine")]
    assert program.delegates() == 1 and not program.ops_outside()
    assert_close(program.run(*inputs), expected, atol=1e-5, rtol=1e-5)


def test_native_layer_norm_is_rewritten_on_a_copy_and_computes_the_same():
    module, inputs = NormBetween(width=16).eval(), _inputs((4, 16))
    program = torch.export.export(module, inputs).run_decompositions()
    code = program.graph_module.code
    assert "native_layer_norm" in code
    with collect_decisions() as decisions:
        rewritten = layer_norms_as_delegated_ops(program, bf16=False)
    assert program.graph_module.code == code
    assert [d.applied for d in decisions if d.fold == FOLD] == [True]
    targets = [n.target for n in rewritten.graph.nodes if n.op == "call_function"]
    assert aten.native_layer_norm.default not in targets and aten.mean.dim not in targets
    assert targets.count(aten.linear.default) == 2
    torch.testing.assert_close(rewritten.module()(*inputs), module(*inputs), atol=1e-5, rtol=1e-5)


@settings(max_examples=2, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=0, max_size=3).map(lambda s: [*s, 12]),
    affine=st.booleans(),
    bias=st.booleans(),
)
def test_generated_norms_join_the_delegate_and_match_eager(shape, affine, bias):
    module, inputs = NormBetween(12, affine, bias).eval(), _inputs(shape, seed=len(shape))
    program, expected, decisions = _lower(module, inputs)
    assert [d.applied for d in decisions] == [True]
    assert not any(op in program.ops_outside() for op in NORM_OPS)
    assert_close(program.run(*inputs), expected, atol=1e-5, rtol=1e-5)


def _audio(length: int) -> tuple[torch.Tensor]:
    return _inputs((1, 1, length), seed=length)


def _sequence(length: int) -> tuple[torch.Tensor]:
    return _inputs((1, length, 32), seed=length)


@pytest.mark.parametrize(
    ("module", "make_inputs", "axis"),
    [
        (NormBetween(), _sequence, LengthAxis(((1,),), 2, 40, 9)),
        (ChannelNormBetweenConvs(), _audio, LengthAxis(((2,),), 60, 400, 200)),
    ],
    ids=["sequence", "audio-through-a-transpose"],
)
def test_a_dynamic_length_is_rewritten_as_the_static_one_and_matches_eager_at_the_bounds(
    module, make_inputs, axis
):
    torch.manual_seed(4)
    pair = lower_static_and_dynamic(module, make_inputs, axis, lambda: [XnnpackPartitioner()])
    assert decisions_apart(pair, lambda fold: fold == FOLD) == ({}, {})
    assert [d.applied for d in pair.dynamic.decisions if d.fold == FOLD] == [True]
    static, dynamic = pair.static.program, pair.dynamic.program
    assert static.delegates() == dynamic.delegates() == 1
    assert not static.ops_outside() and not dynamic.ops_outside()
    errors = dynamic_errors(pair)
    assert {axis.low, axis.high} <= set(errors) and len(errors) == 4
    assert max(errors.values()) <= 1e-5, errors


class NormsApart(torch.nn.Module):
    """Two norms of one width with a cumulative sum (no XNNPACK config) between them:
    each norm lies in its own delegate."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.LayerNorm(16), torch.nn.LayerNorm(16)

    def forward(self, x):
        return self.second(torch.cumsum(self.first(x), dim=1))


def test_norms_in_two_delegates_lower_and_match_eager():
    """Had their GEMVs shared one column, both lowered modules would claim it and
    `to_executorch` would fail (`... is not a buffer`), as WavLM's dynamic export did."""
    torch.manual_seed(5)
    module, inputs = NormsApart().eval(), _inputs((2, 5, 16))
    program, expected, decisions = _lower(module, inputs)
    assert [d.applied for d in decisions] == [True, True]
    assert program.delegates() == 2
    assert_close(program.run(*inputs), expected, atol=1e-5, rtol=1e-5)
