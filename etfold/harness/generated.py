# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Generated differential cases: one builder per case family, picked by the case's type.

A case is a frozen dataclass of plain values (printable, so a failing case is
its own repro); `build(case)` turns it into a seeded module, its inputs and a
call schedule. The hypothesis strategies that draw cases are
`etfold.harness.fuzz_strategies`;
the runner that lowers them with stock ExecuTorch and etfold is
`etfold.harness.differential`.

Families, one module each:
- `WeightFoldCase`: GEMM stacks (conv1d/2d, transposed, linear) whose weights
  are computed from parameters (parametrizations, user expressions, shared
  parameters, buffers), for the XNNPACK pre-decomposition weight fold.
- `ConvertsCase`: chains of fp32/bf16/fp16 regions joined by casts, for the
  XNNPACK dtype-convert delegation.
- `ScalarMulCase`: conv * scale variants, for the Arm scalar-mul fold.
- `DyTCase`: DyT then a conv, for the Arm DyT folds.
- `UpstreamFoldsCase`: conv/linear + batch norm / activation / scale chains with shared
  constants, for upstream's fusions around etfold's folds (both backends).
"""

from __future__ import annotations

import dataclasses

from etfold.harness.generated_cases import Built
from etfold.harness.generated_converts import ConvertsCase, build_converts
from etfold.harness.generated_dyt import DyTCase, build_dyt
from etfold.harness.generated_scalar_mul import ScalarMulCase, build_scalar_mul
from etfold.harness.generated_upstream_folds import UpstreamFoldsCase, build_upstream_folds
from etfold.harness.generated_weight_fold import WeightFoldCase, build_weight_fold

BUILDERS = {
    WeightFoldCase: build_weight_fold,
    ConvertsCase: build_converts,
    ScalarMulCase: build_scalar_mul,
    DyTCase: build_dyt,
    UpstreamFoldsCase: build_upstream_folds,
}


def build(case) -> Built:
    return BUILDERS[type(case)](case)


def describe(case) -> str:
    """The case as a constructor call: paste it to reproduce."""
    return repr(case)


def replace(case, **changes):
    return dataclasses.replace(case, **changes)
