# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The Vela helper: a lowering through EthosUPartitioner returns Vela's own estimate."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from etfold.harness import vela


def test_reads_a_vela_summary(tmp_path):
    path = tmp_path / "out_summary_Ethos_U55_High_End_Embedded.csv"
    path.write_text(
        "experiment,network,sram_memory_used,on_chip_flash_memory_used,"
        "off_chip_flash_memory_used,total_npu_encoded_weights,cycles_npu,cycles_total\n"
        "default,out,2.5,0.0,1.5,544,7712.0,8608.0\n"
    )
    estimate = vela.read_summary(path)
    assert (estimate.total_cycles, estimate.npu_cycles) == (8608, 7712)
    assert (estimate.sram_bytes, estimate.flash_bytes, estimate.encoded_weight_bytes) == (
        2560,
        1536,
        544,
    )


def test_rejects_a_target_that_is_not_an_ethos_u():
    pytest.importorskip("ethosu.vela")
    with pytest.raises(ValueError, match="not an Ethos-U target"):
        vela.ethos_u_compile_spec("TOSA-1.0+INT")


def test_lowers_for_ethos_u55_and_restores_upstream():
    pytest.importorskip("ethosu.vela")
    backend = importlib.import_module(vela._BACKEND_MODULE)
    original = backend.vela_compile

    class ConvScale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)

        def forward(self, x):
            return torch.relu(self.conv(x)) * 0.5

    torch.manual_seed(0)
    module, inputs = ConvScale().eval(), (torch.randn(1, 3, 8, 8),)
    before = copy.deepcopy(module.state_dict())
    program = vela.lower_module_ethos_u(module, inputs, vela.U55)
    assert backend.vela_compile is original
    assert program.delegates() == 1 and len(program.estimates) == 1
    estimate = program.estimate
    assert 0 < estimate.npu_cycles <= estimate.total_cycles
    assert estimate.sram_bytes > 0 and estimate.encoded_weight_bytes > 0
    assert program.operator_counts()["CONV2D"] == 1
    assert "Ethos_U55_128" in estimate.log
    for name, value in module.state_dict().items():
        assert torch.equal(value, before[name])
