# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""etfold's XnnpackDynamicallyQuantizedPartitioner against upstream's.

A dynamically quantized block (linear -> RMSNorm -> linear, pt2e with XNNPACK's
dynamic per-channel config), static and with a dynamic sequence: the same delegates,
the same ops outside (the norm is not rewritten for a partitioner that would leave it
outside), and outputs equal to upstream's lowering on the runtime.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from executorch.backends.xnnpack.partition import xnnpack_partitioner as upstream
from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
    XNNPACKQuantizer,
    get_symmetric_quantization_config,
)
from torch.export import Dim
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from etfold.backends.xnnpack import XnnpackDynamicallyQuantizedPartitioner
from etfold.harness.xnnpack_runner import lower_xnnpack


class LinearNormLinear(torch.nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.down(h)


def test_keeps_upstreams_signature_and_refuses_config_precisions():
    ours = XnnpackDynamicallyQuantizedPartitioner
    theirs = upstream.XnnpackDynamicallyQuantizedPartitioner
    assert inspect.signature(ours.__init__) == inspect.signature(theirs.__init__)
    with pytest.raises(ValueError, match="config_precisions"):
        ours(config_precisions=None)


def test_holds_exactly_the_configs_upstream_enables():
    ours = XnnpackDynamicallyQuantizedPartitioner().target_partitioner_configs
    theirs = upstream.XnnpackDynamicallyQuantizedPartitioner().target_partitioner_configs
    assert {t: c.enabled_precision_types for t, c in ours.items()} == {
        t: c.enabled_precision_types for t, c in theirs.items() if c.enabled_precision_types
    }


def _quantized_program(dynamic: bool):
    torch.manual_seed(0)
    module = LinearNormLinear().eval()
    inputs = (torch.randn(1, 12, 32),)
    shapes = ({1: Dim("tokens", min=2, max=24)},) if dynamic else None
    quantizer = XNNPACKQuantizer().set_global(
        get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True)
    )
    prepared = prepare_pt2e(
        torch.export.export(module, inputs, dynamic_shapes=shapes).module(), quantizer
    )
    prepared(*inputs)
    converted = convert_pt2e(prepared)
    return torch.export.export(converted, inputs, dynamic_shapes=shapes), inputs


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_lowers_a_dynamically_quantized_block_as_upstream_does(dynamic):
    program, inputs = _quantized_program(dynamic)
    theirs = lower_xnnpack(program, [upstream.XnnpackDynamicallyQuantizedPartitioner()])
    ours = lower_xnnpack(program, [XnnpackDynamicallyQuantizedPartitioner()])
    assert ours.delegates() == theirs.delegates() == 2
    assert ours.ops_outside() == theirs.ops_outside()
    assert "aten.mean.dim" in ours.ops_outside()
    lengths = [inputs[0]] + ([torch.randn(1, 2, 32), torch.randn(1, 24, 32)] if dynamic else [])
    for x in lengths:
        torch.testing.assert_close(ours.run(x), theirs.run(x), atol=1e-5, rtol=0)


def test_a_layer_norms_row_means_stay_in_the_general_partitioners_delegate():
    """The general partitioner writes the norm's row means as GEMVs; taken here one per
    delegate (as upstream's GEMM configs take fp32 linears), they would cut the norm in
    three. The linear is this partitioner's; the whole norm is the general one's."""
    from etfold.backends.xnnpack import XnnpackPartitioner
    from etfold.exir import to_edge_transform_and_lower
    from etfold.harness.xnnpack_runner import assert_close, eager_outputs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)).eval()
    x = torch.randn(3, 16)
    partitioners = [XnnpackDynamicallyQuantizedPartitioner(), XnnpackPartitioner()]
    program = lower_xnnpack(
        torch.export.export(model, (x,)), partitioners, lower=to_edge_transform_and_lower
    )
    assert program.delegates() == 2 and not program.ops_outside()
    assert_close(program.run(x), eager_outputs(model, (x,)), atol=1e-5, rtol=1e-5)
