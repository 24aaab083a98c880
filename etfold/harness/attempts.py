# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""One lowering's attempt at a generated case, and the rollouts it is judged on.

An `Attempt` holds what a lowering produced (outputs per call, delegates, output
LSBs) or the error it raised: a crash is a verdict, not a test error. A rollout
runs every call of a case's schedule on one program, feeding state back where
the case carries it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.export import ExportedProgram

from etfold.harness.generated_cases import Built
from etfold.harness.xnnpack_runner import max_abs_error


def first_line(error: BaseException) -> str:
    """The error's type and the first non-empty line of its message."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


@dataclass
class Attempt:
    outputs: list[list[torch.Tensor]] | None = None  # per call
    error: BaseException | None = None
    delegates: int = 0
    ops_outside: int = 0  # XNNPACK: ops left outside delegates, over the methods
    lsb: list[float | None] = field(default_factory=list)  # TOSA INT: per user output
    program: object = None
    quantized: ExportedProgram | None = None  # Arm: the program as lowered, before lowering


def attempt(fn: Callable[[], Attempt]) -> Attempt:
    try:
        return fn()
    except Exception as error:  # a crash is a verdict, not a test error
        return Attempt(error=error)


def attempt_value(fn):
    try:
        return fn()
    except Exception as error:
        return error


def eager_rollout(built: Built) -> list[list[torch.Tensor]]:
    """Every call of the schedule on one private copy of the module."""
    module = copy.deepcopy(built.module)
    return rollout(built, lambda method, inputs: getattr(module, method)(*inputs))


def attempt_eager(built: Built) -> list[list[torch.Tensor]] | None:
    """The eager rollout, or None when the model itself fails in eager."""
    try:
        return eager_rollout(built)
    except Exception:
        return None


def rollout(
    built: Built,
    call: Callable[[str, tuple], object],
    forced: list[list[torch.Tensor]] | None = None,
) -> list[list[torch.Tensor]]:
    """Every call of the schedule; with feedback, each call's state input is the
    previous call's state output, that of `forced` (the eager rollout) when given.

    Forcing measures each step's own error: a free-running quantized loop
    amplifies the first step's rounding through the state, for any two
    lowerings that round differently (drift is measured by bench/bench_arm_npu.py).
    """
    results, previous = [], None
    with torch.no_grad():
        for index, step in enumerate(built.calls):
            inputs = list(step.inputs)
            if built.feedback is not None and index > 0:
                out_index, in_index = built.feedback
                source = forced[index - 1] if forced is not None else previous
                inputs[in_index] = source[out_index]
            out = call(step.method, tuple(inputs))
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            outs = [o.detach().clone() for o in outs]
            results.append(outs)
            previous = outs
    return results


def calibrated_on_the_rollout(built: Built, expected) -> Built:
    """With feedback, calibrate on the states the calls will get too: a state outside
    the calibrated range saturates both lowerings, each in its own way."""
    if built.feedback is None or expected is None:
        return built
    out_index, in_index = built.feedback
    states = []
    for index, call in enumerate(built.calls[1:], start=1):
        inputs = list(call.inputs)
        inputs[in_index] = expected[index - 1][out_index]
        states.append(tuple(inputs))
    return dataclasses.replace(built, calibration=[*built.calibration, *states])


def worst_error(actual: list[list[torch.Tensor]], expected: list[list[torch.Tensor]]) -> float:
    return max(max_abs_error(a, e) for a, e in zip(actual, expected, strict=True))


def output_scale(expected: list[list[torch.Tensor]]) -> float:
    finite = [o.double().abs()[o.isfinite()] for outs in expected for o in outs]
    peaks = [float(f.max()) for f in finite if f.numel()]
    return max([1.0, *peaks])


def error_or_inf(actual, expected) -> float:
    """The worst error over a rollout; a structural mismatch counts as infinitely wrong."""
    try:
        return worst_error(actual, expected)
    except AssertionError:
        return float("inf")


Prepare = Callable[[ExportedProgram], None]
