# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""`etfold lower`: a user's saved `ExportedProgram` to etfold's `.pte`, with what folded.

The lowering is the report's etfold lowering (`etfold.report`, the harness
runners): XNNPACK through etfold's partitioner and entry point; Arm targets
quantized (INT) with upstream's quantizer while etfold's Arm folds are
registered, then lowered with upstream's TOSA or Ethos-U partitioner.

Integer targets calibrate on the example inputs, then on the samples given
(`etfold.calibration`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from etfold.decisions import FoldDecision, collect_decisions
from etfold.report import UserInputError

XNNPACK = "xnnpack"
TOSA_INT = "tosa-int"
TOSA_FP = "tosa-fp"
ETHOS_U55 = "ethos-u55"
ETHOS_U85 = "ethos-u85"
TARGETS = (XNNPACK, TOSA_INT, TOSA_FP, ETHOS_U55, ETHOS_U85)
ARM_TARGETS = (TOSA_INT, TOSA_FP, ETHOS_U55, ETHOS_U85)
QUANTIZED_TARGETS = (TOSA_INT, ETHOS_U55, ETHOS_U85)
# the `etfold report` backend whose catalogue entry names a target's extras
REPORT_BACKEND = {target: "arm" if target in ARM_TARGETS else target for target in TARGETS}


@dataclass
class LoweredProgram:
    """etfold's lowering of one program for one target, and what the summary reads from it."""

    target: str
    pte: bytes
    delegates: int
    ops_outside: dict[str, int]
    decisions: list[FoldDecision]
    # the lowered program (XnnpackProgram, TosaProgram or EthosUProgram); runs keep it alive
    program: Any = field(repr=False)

    def write(self, path: str) -> None:
        with open(path, "wb") as out:
            out.write(self.pte)


def _lower_xnnpack(program, inputs) -> LoweredProgram:
    from etfold.report import xnnpack_lowering

    lowered = xnnpack_lowering("etfold", program, {})
    return LoweredProgram(
        XNNPACK,
        bytes(lowered.executorch.buffer),
        lowered.delegates(),
        dict(lowered.ops_outside()),
        [],
        lowered,
    )


def _lower_tosa(program, inputs, target: str, calibration) -> LoweredProgram:
    from etfold.harness import tosa_runner

    if target == TOSA_INT:
        program = tosa_runner.quantize_exported_for_tosa(program, inputs, calibration=calibration)
        lowered = tosa_runner.lower_tosa(program, tosa_runner.INT)
    else:
        lowered = tosa_runner.lower_tosa(program, tosa_runner.FP)
    delegates, outside = lowered.delegates(), dict(lowered.ops_outside())
    pte = bytes(lowered.edge.to_executorch().buffer)
    return LoweredProgram(target, pte, delegates, outside, [], lowered)


def _lower_ethos_u(program, inputs, target: str, calibration) -> LoweredProgram:
    from etfold.harness import tosa_runner, vela

    vela_target = vela.U55 if target == ETHOS_U55 else vela.U85
    quantizer = vela.ethos_u_quantizer(vela_target)
    quantized = tosa_runner.quantize_exported(program, quantizer, inputs, calibration)
    lowered = vela.lower_ethos_u(quantized, vela_target)
    delegates = lowered.delegates()
    outside = dict(_ops_outside(lowered.edge))
    pte = bytes(lowered.edge.to_executorch().buffer)
    return LoweredProgram(target, pte, delegates, outside, [], lowered)


def _ops_outside(edge):
    from etfold.harness.inspection import ops_outside_delegates

    return ops_outside_delegates(edge.exported_program())


def lower_program(program, target: str, calibration: Sequence[tuple] = ()) -> LoweredProgram:
    """etfold's lowering of `program` (an ExportedProgram saved with positional example
    inputs) for `target`, every fold decision recorded. The program is not modified.

    Integer targets calibrate on the example inputs and then on `calibration`.
    """
    if target not in TARGETS:
        raise UserInputError(f"unknown target {target!r}; expected one of {', '.join(TARGETS)}")
    args, _ = program.example_inputs
    inputs = tuple(args)
    # quantization runs on stock torch; the harness speeds up each lowering call itself
    with collect_decisions() as decisions, _folds_for(target):
        if target == XNNPACK:
            lowered = _lower_xnnpack(program, inputs)
        elif target in (TOSA_INT, TOSA_FP):
            lowered = _lower_tosa(program, inputs, target, calibration)
        else:
            lowered = _lower_ethos_u(program, inputs, target, calibration)
    lowered.decisions = list(decisions)
    return lowered


def _folds_for(target: str):
    if target not in ARM_TARGETS:
        return contextlib.nullcontext()
    from etfold.backends.arm import arm_folds_registered

    return arm_folds_registered()


def _counted(ops: dict[str, int]) -> str:
    if not ops:
        return "none"
    return ", ".join(f"{name}×{count}" for name, count in sorted(ops.items()))


def summary(lowered: LoweredProgram, *, explain: bool = False) -> list[str]:
    """A few lines: size, delegates, ops outside, folds applied and declined.

    Decisions are grouped by fold and reason; `explain` lists each one with its node.
    """
    from etfold.report import decision_notes

    applied = [_record(d) for d in lowered.decisions if d.applied]
    declined = [_record(d) for d in lowered.decisions if not d.applied]
    lines = [
        f"{lowered.target}: {len(lowered.pte):,} bytes, {lowered.delegates} delegate(s)",
        f"ops outside delegates: {_counted(lowered.ops_outside)}",
        f"folds: {len(applied)} applied, {len(declined)} declined",
    ]
    lines += decision_notes("  applied ", applied, explain)
    lines += decision_notes("  declined", declined, explain)
    return lines


def _record(decision: FoldDecision) -> dict[str, str]:
    return {"fold": decision.fold, "where": decision.where, "detail": decision.detail}
