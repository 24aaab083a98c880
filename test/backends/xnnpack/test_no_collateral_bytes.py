# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""No collateral bytes: where nothing folds, etfold's entry point and partitioner write
stock's program byte for byte; the convert compile spec goes only on delegates holding a
delegated convert."""

from __future__ import annotations

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack.install import DTYPE_CONVERTS_SPEC
from etfold.decisions import collect_decisions
from etfold.demo_models.plain_models import ConvBlock
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.inspection import lowered_modules
from etfold.harness.xnnpack_runner import assert_close, eager_outputs, export_method, lower_xnnpack


class Chain(torch.nn.Module):
    """Linear, ReLU, linear: nothing in it folds, in any float dtype."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _chain(dtype):
    def build():
        torch.manual_seed(0)
        return Chain().to(dtype).eval(), (torch.randn(4, 32).to(dtype),)

    return build


def _quantized():
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    torch.manual_seed(0)
    module, inputs = Chain().eval(), (torch.randn(4, 32),)
    graph = torch.export.export(module, inputs).module()
    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config())
    graph = prepare_pt2e(graph, quantizer)
    graph(*inputs)
    return convert_pt2e(graph), inputs


def _channels_last():
    torch.manual_seed(0)
    module = ConvBlock(3, 8).eval()
    return module, (torch.randn(1, 3, 16, 16).to(memory_format=torch.channels_last),)


# (build, partitioner kwargs given to both partitioners alike)
STOCK_SHAPED = {
    "fp32": (_chain(torch.float32), {}),
    "fp16": (_chain(torch.float16), {}),
    "bf16": (_chain(torch.bfloat16), {"enable_bf16": True}),
    "quantized": (_quantized, {}),
    "channels_last": (_channels_last, {}),
}


@pytest.mark.parametrize("name", list(STOCK_SHAPED))
def test_a_program_where_nothing_folds_lowers_byte_identically_to_stock(name):
    build, kwargs = STOCK_SHAPED[name]
    module, inputs = build()
    stock = lower_xnnpack(
        export_method(module, "forward", inputs), [UpstreamXnnpackPartitioner(**kwargs)]
    )
    with collect_decisions() as decisions:
        etfold = lower_xnnpack(
            export_method(module, "forward", inputs),
            [XnnpackPartitioner(**kwargs)],
            lower=to_edge_transform_and_lower,
        )
    assert not [d for d in decisions if d.applied]
    assert stock.delegates() >= 1
    assert bytes(etfold.executorch.buffer) == bytes(stock.executorch.buffer)
    assert_close(etfold.run(*inputs), stock.run(*inputs), atol=0)


class ConvertInSecondDelegate(torch.nn.Module):
    """Two delegates split by a cumsum (XNNPACK has none); only the second converts."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.cumsum(self.a(x), -1)).half()


def test_only_the_delegate_holding_a_convert_carries_the_compile_spec():
    torch.manual_seed(0)
    module, inputs = ConvertInSecondDelegate().eval(), (torch.randn(2, 16),)
    lowered = lower_xnnpack(
        torch.export.export(module, inputs),
        [XnnpackPartitioner()],
        lower=to_edge_transform_and_lower,
    )
    specs = [m.compile_specs for m in lowered_modules(lowered.edge.exported_program())]
    assert specs == [[], [DTYPE_CONVERTS_SPEC]]
    assert dict(lowered.ops_outside()) == {"aten.cumsum.default": 1}
    assert_close(lowered.run(*inputs), eager_outputs(module, inputs), atol=2e-3, rtol=2e-3)
