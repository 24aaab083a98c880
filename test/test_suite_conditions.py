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
