# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""What a built-in report model declares."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

Built = tuple[torch.nn.Module, tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class DemoModel:
    """A model `etfold report` lowers with stock ExecuTorch and with etfold.

    `build` returns a module with random weights (seeded inside, from a config
    written in code) and its example inputs. `backend` is "xnnpack" or "arm"
    (Arm models are quantized for TOSA-1.0+INT and run on the reference model).
    `calibration` returns extra calibration samples for Arm models.
    `partitioner_kwargs` go to both XNNPACK partitioners, stock and etfold
    (e.g. `enable_bf16=True`), so the comparison is like for like.
    `requires` names the Python modules the model needs beyond etfold's core
    dependencies (e.g. "transformers"); the report skips it, naming the extra
    that brings them, when one is missing. `default` puts the model in the set
    a plain `etfold report` runs (one model per fold family and backend, so the
    default run stays a few minutes; `--all` runs every model). Write the
    `DemoModel(...)` call with literal strings so `etfold report --list` can
    read it without imports.
    """

    name: str
    backend: str
    build: Callable[[], Built]
    description: str
    calibration: Callable[[], list[tuple[torch.Tensor, ...]]] = field(default=lambda: [])
    partitioner_kwargs: Mapping[str, Any] = field(default_factory=dict)
    requires: tuple[str, ...] = ()
    # a mixed-precision model's fp32 twin: the report shows its delegates and ops outside
    fp32_twin: Callable[[], Built] | None = None
    default: bool = False
