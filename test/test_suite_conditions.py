# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The conditions `test/conftest.py` sets up for every test, checked from inside one."""

import torch
from torch._logging._internal import trace_log


class _Relu(torch.nn.Module):
    def forward(self, x):
        return x.relu()


def test_torchs_trace_logger_keeps_no_handler_of_its_own_as_outside_pytest():
    """Torch builds each structured-trace payload (printed graphs, stack summaries) only
    while its trace logger has a handler; outside pytest it has none after the first
    event, and pytest's log capture must not give it one."""
    torch.export.export(_Relu(), (torch.randn(3),)).run_decompositions()
    assert trace_log.handlers == []


def test_tests_lower_etfolds_programs_with_the_speedups_and_stocks_without():
    """The suite's switch: etfold's entry point lowers with the speed-ups, as users get
    it; the harness's stock lowering runs on torch's own code, and torch is as it was
    once each lowering returns (its own `GraphModule.__new__`)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
        XnnpackPartitioner as StockPartitioner,
    )

    from etfold.exir.program.speedups import speedups_enabled, stock_lowerings_unpatched
    from etfold.harness.xnnpack_runner import lower_xnnpack

    assert speedups_enabled() and stock_lowerings_unpatched()
    stock = lower_xnnpack(torch.export.export(_Relu(), (torch.randn(3),)), [StockPartitioner()])
    graph_module = stock.edge.exported_program().graph_module
    assert type(graph_module).__mro__[1] is torch.fx.GraphModule
    new = torch.fx.GraphModule.__dict__["__new__"]
    assert new.__func__.__module__ == "torch.fx.graph_module"
