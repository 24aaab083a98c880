# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A softmax over the last axis inside a delegate that also holds NHWC ops reads NCHW data.

Every model runs on the XNNPACK runtime and is compared with eager.
"""

from __future__ import annotations

import pytest
import torch
from executorch.backends.xnnpack._passes.channels_last_tagged_reshape_pass import (
    ChannelsLastTaggedReshapePass,
)
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.last_axis_ops_read_nchw import (
    LAYOUT_GUARD_SPEC,
    last_axis_ops_read_nchw,
)
from etfold.exir import to_edge_transform_and_lower as etfold_lower
from etfold.harness.xnnpack_runner import lower_module_xnnpack, max_abs_error

NARROW = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


class ConvSoftmaxBetweenCasts(torch.nn.Module):
    """fp16 grouped conv, softmax in fp32, then a channels-last cast (the reported program)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 15, 3, groups=3, bias=True)

    def forward(self, x):
        x = x + 0.5 * torch.tanh(x)
        x = self.conv(x)
        x = torch.softmax(x.float(), dim=-1).to(torch.float16)
        x = x.to(dtype=torch.float32, memory_format=torch.channels_last)
        return x.float()


class ConvThenLastAxisOp(torch.nn.Module):
    def __init__(self, op: str, channels: int = 6, groups: int = 3, in_channels: int = 3):
        super().__init__()
        self.op = op
        self.conv = torch.nn.Conv2d(in_channels, channels, 3, groups=groups)

    def last_axis(self, h):
        if self.op == "softmax":
            return torch.softmax(h, dim=-1)
        if self.op == "log_softmax":
            return torch.log_softmax(h, dim=-1)
        if self.op == "layer_norm":
            return torch.nn.functional.layer_norm(h, h.shape[-1:])
        return torch.nn.functional.gelu(h)

    def forward(self, x):
        return self.last_axis(self.conv(x))


class NarrowCastsAround(ConvThenLastAxisOp):
    """narrow -> fp32 (conv, last-axis op) -> narrow, with a channels-last cast at one end."""

    def __init__(self, op: str, dtype: torch.dtype, channels_last: str):
        super().__init__(op)
        self.dtype, self.channels_last = dtype, channels_last

    def forward(self, x):
        into = torch.channels_last if self.channels_last == "into_fp32" else torch.contiguous_format
        out_of = (
            torch.channels_last if self.channels_last == "out_of_fp32" else torch.contiguous_format
        )
        h = x.to(dtype=torch.float32, memory_format=into)
        h = self.last_axis(self.conv(h))
        return h.to(dtype=self.dtype, memory_format=out_of)


def _etfold(module, inputs, **kwargs):
    return lower_module_xnnpack(module, inputs, [XnnpackPartitioner(**kwargs)], lower=etfold_lower)


def _stock(module, inputs, **kwargs):
    return lower_module_xnnpack(module, inputs, [UpstreamXnnpackPartitioner(**kwargs)])


def test_reported_fp16_program_matches_stock_accuracy():
    torch.manual_seed(0)
    module, x = ConvSoftmaxBetweenCasts().half().eval(), torch.randn(1, 3, 4, 9).half()
    stock, reference = _stock(module, (x,), enable_bf16=True)
    ours, _ = _etfold(module, (x,), enable_bf16=True)
    stock_error = max_abs_error(stock.run(x), reference)
    assert max_abs_error(ours.run(x), reference) <= max(10 * stock_error, 1e-3)
    assert ours.delegates() <= stock.delegates()


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_fp32_conv_then_last_axis_op_is_exact(op):
    """Stock normalizes over channels here; etfold converts the conv output back to NCHW."""
    torch.manual_seed(1)
    module, x = ConvThenLastAxisOp(op).eval(), torch.randn(1, 3, 5, 8)
    program, reference = _etfold(module, (x,))
    assert max_abs_error(program.run(x), reference) <= 1e-5


def _casts_around(dtype: torch.dtype, op: str, channels_last: str):
    """One case; `make test` runs the half of the grid in which every two of dtype, op and
    layout meet (the dtype alternates over op x layout), `make test-long` the other half."""
    ops, layouts = ["softmax", "layer_norm", "gelu"], ["none", "into_fp32", "out_of_fp32"]
    short = list(NARROW)[(ops.index(op) + layouts.index(channels_last)) % 2]
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    marks = [] if dtype is short else [pytest.mark.long]
    return pytest.param(dtype, op, channels_last, id=f"{name}-{op}-{channels_last}", marks=marks)


@pytest.mark.parametrize(
    "dtype, op, channels_last",
    [
        _casts_around(dtype, op, channels_last)
        for dtype in NARROW
        for op in ("softmax", "layer_norm", "gelu")
        for channels_last in ("none", "into_fp32", "out_of_fp32")
    ],
)
def test_channels_last_casts_around_fp32_last_axis_ops(dtype, op, channels_last):
    torch.manual_seed(2)
    module = NarrowCastsAround(op, dtype, channels_last).eval()
    x = torch.randn(1, 3, 6, 7).to(dtype)
    program, reference = _etfold(module, (x,), enable_bf16=True)
    (actual,) = program.run(x)
    assert actual.dtype == dtype
    scale = reference[0].float().abs().max().item()
    assert max_abs_error([actual], reference) <= NARROW[dtype] * max(scale, 1.0)


def test_guard_spec_only_where_a_last_axis_op_may_read_nhwc():
    torch.manual_seed(3)

    class Attention(torch.nn.Module):  # 4-D softmax, nothing NHWC
        def forward(self, q, k):
            return torch.softmax(q @ k.transpose(-1, -2), dim=-1)

    cases = [
        (ConvThenLastAxisOp("softmax").eval(), (torch.randn(1, 3, 5, 8),), True),
        (ConvThenLastAxisOp("gelu").eval(), (torch.randn(1, 3, 5, 8),), False),
        (Attention(), (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)), False),
    ]
    for module, inputs, guarded in cases:
        edge = etfold_lower(torch.export.export(module, inputs), partitioner=[])
        result = XnnpackPartitioner().partition(edge.exported_program())
        specs = [s for spec in result.partition_tags.values() for s in spec.compile_specs]
        assert (LAYOUT_GUARD_SPEC in specs) is guarded, type(module).__name__


def test_guard_restores_upstream_set_after_use_and_nesting():
    original = ChannelsLastTaggedReshapePass.memory_sensitive_ops_nchw
    with last_axis_ops_read_nchw():
        with last_axis_ops_read_nchw():
            assert len(ChannelsLastTaggedReshapePass.memory_sensitive_ops_nchw) > len(original)
        assert ChannelsLastTaggedReshapePass.memory_sensitive_ops_nchw is not original
    assert ChannelsLastTaggedReshapePass.memory_sensitive_ops_nchw is original


def test_guard_extends_the_set_only_in_its_own_thread():
    """A stock lowering running beside a guarded preprocess sees upstream's set."""
    import threading

    from etfold.backends.xnnpack._passes.last_axis_ops_read_nchw import LAST_AXIS_OPS

    original = ChannelsLastTaggedReshapePass.memory_sensitive_ops_nchw
    opened, seen, done = threading.Event(), {}, threading.Event()

    def guarded():
        with last_axis_ops_read_nchw():
            seen["guarded"] = ChannelsLastTaggedReshapePass.memory_sensitive_ops_nchw
            opened.set()
            done.wait(timeout=30)

    thread = threading.Thread(target=guarded)
    thread.start()
    assert opened.wait(timeout=30)
    seen["beside"] = ChannelsLastTaggedReshapePass.memory_sensitive_ops_nchw
    done.set()
    thread.join()
    assert seen["guarded"] >= LAST_AXIS_OPS
    assert seen["beside"] == original and not LAST_AXIS_OPS & seen["beside"]
    assert ChannelsLastTaggedReshapePass.memory_sensitive_ops_nchw is original


@settings(
    max_examples=2, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    groups=st.sampled_from([1, 2, 3]),
    multiplier=st.integers(1, 4),
    height=st.integers(3, 7),
    width=st.integers(3, 11),
    half=st.booleans(),
)
def test_generated_conv_softmax_shapes_never_mismatch(groups, multiplier, height, width, half):
    torch.manual_seed(height * 13 + width)
    in_channels = 3 * groups if groups > 1 else 3
    module = ConvThenLastAxisOp("softmax", groups * multiplier, groups, in_channels).eval()
    x = torch.randn(1, in_channels, height, width)
    if half:
        module, x = module.half(), x.half()
    program, reference = _etfold(module, (x,), enable_bf16=True)
    assert max_abs_error(program.run(x), reference) <= (2e-3 if half else 1e-5)


class SoftmaxOfChannelsLastCopy(torch.nn.Module):
    """A channels-last copy of a one-channel tensor: contiguous by its strides too, yet
    XNNPACK tags the copy NHWC, so its softmax over W must read NCHW."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        h = x.to(dtype=self.dtype, memory_format=torch.channels_last)
        return torch.softmax(h.float(), dim=-1).to(self.dtype)


# each shape and each dtype in `make test`; the other three pairings in `make test-long`
@pytest.mark.parametrize(
    "shape, dtype",
    [
        pytest.param(shape, dtype, id=f"{'x'.join(map(str, shape))}-{name}", marks=marks)
        for shape, short in (((1, 1, 1, 9), "fp32"), ((1, 1, 4, 6), "bf16"), ((2, 1, 3, 5), "fp32"))
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
        for marks in [[] if name == short else [pytest.mark.long]]
    ],
)
def test_softmax_of_channels_last_copy_with_one_channel_reads_nchw(shape, dtype):
    torch.manual_seed(5)
    x = torch.randn(shape).to(dtype)
    program, reference = _etfold(SoftmaxOfChannelsLastCopy(dtype).eval(), (x,), enable_bf16=True)
    tolerance = 1e-5 if dtype is torch.float32 else NARROW[dtype]
    assert max_abs_error(program.run(x), reference) <= tolerance
