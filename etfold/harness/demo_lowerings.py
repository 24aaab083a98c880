# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Report models lowered once per process through etfold, shared by every test that reads one.

A decoder row costs tens of seconds to lower, and several test files check
different facts about the same lowering (what stays outside, the runtime
output, the delegate count). `lowered_demo(name)` lowers the named XNNPACK
report model as `etfold report` does (its builder, its partitioner arguments,
etfold's entry point and partitioner), collecting the decisions, and caches the
result for the process. Callers read it and never write to it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from etfold.decisions import FoldDecision, collect_decisions
from etfold.harness.xnnpack_runner import XnnpackProgram, lower_module_xnnpack


@dataclass(frozen=True)
class DemoLowering:
    program: XnnpackProgram
    inputs: tuple
    expected: list[torch.Tensor]  # eager outputs of the model as built
    decisions: tuple[FoldDecision, ...]  # recorded while lowering


def lowered_demo(name: str, fp32_twin: bool = False) -> DemoLowering:
    """The XNNPACK report model `name` (or its fp32 twin) lowered through etfold."""
    return _lowered(name, bool(fp32_twin))


@functools.cache  # keyed by value: `f(x)` and `f(x, fp32_twin=False)` share one lowering
def _lowered(name: str, fp32_twin: bool) -> DemoLowering:
    from etfold.backends.xnnpack import XnnpackPartitioner
    from etfold.demo_models import catalogue, load
    from etfold.exir import to_edge_transform_and_lower

    (model,) = load([e for e in catalogue() if e.name == name and e.backend == "xnnpack"])
    build = model.fp32_twin if fp32_twin else model.build
    if build is None:
        raise ValueError(f"{name} has no fp32 twin")
    module, inputs = build()
    partitioner = XnnpackPartitioner(**model.partitioner_kwargs)
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(
            module, inputs, [partitioner], lower=to_edge_transform_and_lower
        )
    return DemoLowering(program, inputs, expected, tuple(decisions))
