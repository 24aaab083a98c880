# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Lower a module exported with dynamic dims, and run it at several sizes within the bounds.

A rewrite must hold for every size the export allows; the runtime resizes the
delegate on each call. `lower_dynamic` exports once with `dynamic_shapes`;
`check_at_sizes` runs the same loaded program on inputs of each size and compares
with eager (typically the minimum, the maximum and one size between).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from etfold.decisions import collect_decisions
from etfold.harness.modules import in_eval_mode
from etfold.harness.xnnpack_runner import (
    XnnpackProgram,
    assert_close,
    eager_outputs,
    lower_xnnpack,
)


def lower_dynamic(
    module: torch.nn.Module,
    example: tuple,
    dynamic_shapes,
    partitioners: Sequence,
    **lower_kwargs,
) -> tuple[XnnpackProgram, list]:
    """The loaded program for `module` exported with `dynamic_shapes` (None: static),
    and the decisions recorded while lowering it."""
    module = in_eval_mode(module)
    program = torch.export.export(module, example, dynamic_shapes=dynamic_shapes)
    with collect_decisions() as decisions:
        lowered = lower_xnnpack(program, partitioners, **lower_kwargs)
    return lowered, list(decisions)


def check_at_sizes(
    program: XnnpackProgram,
    module: torch.nn.Module,
    inputs_at: Callable[[int], tuple],
    sizes: Iterable[int],
    *,
    atol: float,
) -> None:
    """For each size, the runtime's outputs on `inputs_at(size)` match eager's."""
    for size in sizes:
        inputs = inputs_at(size)
        assert_close(program.run(*inputs), eager_outputs(module, inputs), atol=atol)
