# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.


"""What every generated differential case builds into: a module, its methods' example
inputs and the calls to compare (`Built`), with the seeded draws the builders share.
The case families live one per module (`generated_weight_fold`, `generated_converts`,
`generated_scalar_mul`, `generated_dyt`); `generated.build(case)` picks the builder."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Call:
    """One call of a built case: `getattr(module, method)(*inputs)`."""

    method: str
    inputs: tuple[torch.Tensor, ...]


@dataclass
class Built:
    """A case made concrete: the module, the methods to export and the calls to compare."""

    module: nn.Module
    methods: dict[str, tuple[torch.Tensor, ...]]  # method -> example inputs for export
    calls: list[Call]  # in order, on one program instance (stateful rollouts carry over)
    calibration: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    # (output, input): each call after the first takes that input from the previous call's output
    feedback: tuple[int, int] | None = None


def seeded_generator(seed: int) -> torch.Generator:
    """A private generator: a case's draws never depend on the global RNG."""
    return torch.Generator().manual_seed(seed)


def randn(generator: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=generator)


def same_padding(kernel: int, dilation: int) -> int:
    """The smallest padding that keeps a stride-1 conv's output at least as long as its input
    minus one, so no generated size collapses below 1."""
    return math.ceil(dilation * (kernel - 1) / 2)
