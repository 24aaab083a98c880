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


def test_tests_lower_on_stock_torch_with_the_speedups_off_unless_a_test_turns_them_on():
    """A lowering through etfold's entry point, as the fold tests make it, builds torch's
    own graph modules, through torch's own `GraphModule.__new__`."""
    from etfold.backends.xnnpack import XnnpackPartitioner
    from etfold.exir import to_edge_transform_and_lower
    from etfold.exir.program.speedups import speedups_enabled

    assert not speedups_enabled()
    program = torch.export.export(_Relu(), (torch.randn(3),))
    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    assert type(edge.exported_program().graph_module).__mro__[1] is torch.fx.GraphModule
    new = torch.fx.GraphModule.__dict__["__new__"]
    assert new.__func__.__module__ == "torch.fx.graph_module"
