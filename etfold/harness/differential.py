# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Lower one generated case with stock ExecuTorch and with etfold, run both, judge.

The modules: `differential_xnnpack` and `differential_arm` (the two runners),
`verdicts` (verdicts, tolerances, KNOWN_UPSTREAM, the float judge), `int_judge`
(the TOSA INT oracle), `attempts` (one lowering's results and the rollouts).

`run_case(case)` returns an `Outcome` whose verdict is one of:

- ok: etfold's program matches the reference (and every other oracle holds)
- wrong: etfold's program computes a wrong result where the baseline does not,
  folded what a guard must decline, or (TOSA) differs from the unfolded lowering
  of the same quantized program where its folds claim exactness
- crash_etfold: etfold raised where the baseline lowered and ran
- crash_both: the baseline raised too (an upstream failure, see KNOWN_UPSTREAM)
- crash_stock: only the baseline raised (upstream_folds; must be in KNOWN_UPSTREAM)
- upstream_wrong: the baseline is as wrong as etfold (an upstream bug)
- stock_wrong: the baseline's program is wrong and etfold's is right; delegate
  counts are not compared against a wrong program
- mutation: etfold wrote into the user's module or ExportedProgram
  (`etfold.harness.mutation_check`)
- more_delegates: etfold's program has more delegates than the baseline's and no
  fewer ops outside them (XNNPACK; for TOSA, more delegates)

Oracles:
- XNNPACK (weight fold, converts): the baseline is upstream's
  `to_edge_transform_and_lower` with upstream's `XnnpackPartitioner`. Outputs are
  compared with eager at a tolerance for the narrowest dtype in the case, over
  every call of the case's schedule on one loaded program (buffers carry over).
- Arm (scalar-mul, DyT): the baseline is the lowering with etfold's folds not
  registered (for scalar-mul also upstream's own fold retired: it is the unguarded
  one etfold replaces). INT outputs may differ from fp32 eager by no more than the
  baseline's error plus one output LSB; FP outputs must match eager. For DyT the
  integer folds are also checked code for code against the unfolded lowering of
  the very same quantized program.
"""

from __future__ import annotations

from etfold.harness.differential_arm import run_arm_case
from etfold.harness.differential_upstream_folds import run_upstream_folds_case
from etfold.harness.differential_xnnpack import run_xnnpack_case
from etfold.harness.generated_converts import ConvertsCase
from etfold.harness.generated_upstream_folds import UpstreamFoldsCase
from etfold.harness.generated_weight_fold import WeightFoldCase
from etfold.harness.verdicts import Outcome


def run_case(case) -> Outcome:
    """The case through the runner of its backend."""
    if isinstance(case, UpstreamFoldsCase):
        return run_upstream_folds_case(case)
    if isinstance(case, WeightFoldCase | ConvertsCase):
        return run_xnnpack_case(case)
    return run_arm_case(case)
