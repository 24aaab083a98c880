# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Buffer verdicts look inside autocast and grad-mode regions instead of assuming a write."""

from __future__ import annotations

import torch

from etfold.exir.program.buffer_marks import BUFFER_FOLD_BLOCKERS, mark_buffer_fold_blockers


class MaskInsideAutocast(torch.nn.Module):
    def __init__(self, write: bool):
        super().__init__()
        self.write = write
        self.register_buffer("mask", torch.zeros(4))
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", torch.bfloat16):
            if self.write:
                self.mask.add_(1.0)
            return self.proj(x) + self.mask


def _blockers(write: bool) -> tuple[str, ...]:
    program = torch.export.export(MaskInsideAutocast(write).eval(), (torch.randn(2, 4),))
    regions = [
        n for n in program.graph.nodes if n.target is torch.ops.higher_order.wrap_with_autocast
    ]
    assert regions  # the read (and the write) sit inside the region
    mark_buffer_fold_blockers({"forward": program})
    (mask,) = [n for n in program.graph.nodes if n.name == "b_mask"]
    return mask.meta[BUFFER_FOLD_BLOCKERS]


def test_a_buffer_only_read_inside_a_region_may_fold():
    assert _blockers(write=False) == ()


def test_declines_when_the_region_writes_the_buffer():
    assert _blockers(write=True) == (
        "method `forward` may write it (torch.ops.higher_order.wrap_with_autocast)",
    )
