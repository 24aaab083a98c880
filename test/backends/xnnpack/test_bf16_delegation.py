# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""bf16 never falls to portable kernels silently: enabled when unset, a WARNING when refused."""

from __future__ import annotations

import logging

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack.partition.bf16_delegation import FOLD, bf16_setting, match_enable_bf16
from etfold.decisions import Declined, collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.xnnpack_runner import assert_close, lower_module_xnnpack, lower_xnnpack


class Bf16Mlp(torch.nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _bf16_mlp():
    torch.manual_seed(0)
    module = Bf16Mlp().to(torch.bfloat16).eval()
    return module, (torch.randn(4, 64).to(torch.bfloat16),)


def _lower(module, inputs, partitioner):
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(
            module, inputs, [partitioner], lower=to_edge_transform_and_lower
        )
    return program, expected, [d for d in decisions if d.fold == FOLD]


def _gemms_outside(program) -> int:
    outside = program.ops_outside()
    return sum(
        outside[op] for op in ("aten.linear.default", "aten.addmm.default", "aten.mm.default")
    )


def test_bf16_program_is_delegated_when_enable_bf16_is_unset():
    module, inputs = _bf16_mlp()
    partitioner = XnnpackPartitioner()
    program, expected, decisions = _lower(module, inputs, partitioner)
    assert program.delegates() == 1 and sum(program.ops_outside().values()) == 0
    assert [d.applied for d in decisions] == [True]
    assert "enable_bf16 was not set" in decisions[0].detail
    assert_close(program.run(*inputs), expected, atol=3e-2, rtol=2e-2)
    # the user's setting is back on every config once partition() returns
    assert not any(c.enable_bf16 for c in partitioner.target_partitioner_configs.values())


def test_stock_leaves_the_same_program_on_portable():
    module, inputs = _bf16_mlp()
    program, _ = lower_module_xnnpack(module, inputs, [UpstreamXnnpackPartitioner()])
    assert _gemms_outside(program) == 2


def test_declines_at_warning_when_the_user_sets_enable_bf16_false(caplog):
    module, inputs = _bf16_mlp()
    with caplog.at_level(logging.WARNING, logger="etfold"):
        program, expected, decisions = _lower(module, inputs, XnnpackPartitioner(enable_bf16=False))
    assert _gemms_outside(program) == 2
    (declined,) = decisions
    assert not declined.applied
    assert declined.where == "aten_addmm_default, aten_addmm_default_1"
    assert "2 bf16 GEMMs stay on portable kernels (aten_addmm_default, " in declined.detail
    assert any(r.levelno == logging.WARNING and FOLD in r.getMessage() for r in caplog.records)
    assert_close(program.run(*inputs), expected, atol=3e-2, rtol=2e-2)


def test_declines_when_the_user_already_enabled_bf16():
    module, inputs = _bf16_mlp()
    program, expected, decisions = _lower(module, inputs, XnnpackPartitioner(enable_bf16=True))
    assert decisions == [] and program.delegates() == 1
    assert match_enable_bf16(torch.export.export(module, inputs), True) == Declined(
        "enable_bf16=True was set by the user"
    )
    assert_close(program.run(*inputs), expected, atol=3e-2, rtol=2e-2)


def test_declines_when_the_program_computes_nothing_in_bf16():
    torch.manual_seed(0)
    module, inputs = Bf16Mlp().eval(), (torch.randn(4, 64),)
    partitioner = XnnpackPartitioner()
    program, expected, decisions = _lower(module, inputs, partitioner)
    assert decisions == []
    assert match_enable_bf16(torch.export.export(module, inputs), None) == Declined(
        "the program computes nothing in bf16"
    )
    stock = lower_xnnpack(torch.export.export(module, inputs), [UpstreamXnnpackPartitioner()])
    assert program.executorch.buffer == stock.executorch.buffer
    assert_close(program.run(*inputs), expected, atol=1e-5)


def test_no_warning_when_enable_bf16_false_leaves_no_gemm_behind(caplog):
    class Bf16Relu(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x)

    x = torch.randn(4, 8).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="etfold"):
        _, _, decisions = _lower(Bf16Relu(), (x,), XnnpackPartitioner(enable_bf16=False))
    assert decisions == [] and not caplog.records


class Bf16ConvHead(torch.nn.Module):
    """A conv XNNPACK cannot compile in bf16, then a linear it can."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.head = torch.nn.Linear(8 * 8 * 8, 8)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


# With delegated converts on (the default), the widening pass computes a bf16 conv in fp32
# inside the delegate (test_widen_half_precision_ops_pass.py); off, this guard is what
# keeps the program loadable.
@pytest.mark.parametrize("enable_bf16", [None, True], ids=["unset", "user_true"])
def test_declines_bf16_ops_xnnpack_cannot_compile_and_the_program_loads(enable_bf16, caplog):
    torch.manual_seed(0)
    module = Bf16ConvHead().to(torch.bfloat16).eval()
    inputs = (torch.randn(1, 4, 8, 8).to(torch.bfloat16),)
    kwargs = {"delegate_dtype_converts": False}
    kwargs |= {} if enable_bf16 is None else {"enable_bf16": enable_bf16}
    with caplog.at_level(logging.WARNING, logger="etfold"):
        program, expected, decisions = _lower(module, inputs, XnnpackPartitioner(**kwargs))
    assert program.ops_outside()["aten.convolution.default"] == 1
    assert _gemms_outside(program) == 0  # the linear is delegated
    (declined,) = [d for d in decisions if not d.applied]
    assert declined.detail == (
        "XNNPACK in executorch 1.5.1 cannot compile a bf16 convolution; it runs on portable kernels"
    )
    assert any(r.levelno == logging.WARNING for r in caplog.records)
    assert_close(program.run(*inputs), expected, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("op", ["convolution.default", "bmm.default", "_softmax.default"])
def test_no_config_is_enabled_where_the_kernel_fails(op):
    assert not bf16_setting(op, None) and not bf16_setting(op, True)
    assert bf16_setting("linear.default", None) and bf16_setting("linear.default", True)
    assert not bf16_setting("clone.default", None) and bf16_setting("clone.default", True)
