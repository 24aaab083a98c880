# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""One module exported twice, with a static and with a dynamic length, lowered to XNNPACK.

The pair a user cannot tell apart but by `torch.export.Dim`: both lowerings must
take the same fold decisions, except where the recorded reason is the dynamic
shape itself ("dynamic shape: …"), and the dynamic program must match eager at
its lower bound, its upper bound and two lengths between.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.decisions import FoldDecision, collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.modules import in_eval_mode
from etfold.harness.xnnpack_runner import XnnpackProgram, eager_outputs, lower_xnnpack

DYNAMIC_SHAPE_REASON = "dynamic shape"


@dataclass(frozen=True)
class LengthAxis:
    """The inputs' dynamic length: `axes[i]` are input i's axes of that length, and it
    takes `low..high` (the export traces at `traced`)."""

    axes: tuple[tuple[int, ...], ...]
    low: int
    high: int
    traced: int
    step: int = 1  # the length is a multiple of it (whole frames of audio)
    # False: `Dim.DYNAMIC` with the bounds, as users declare audio in samples (torch's
    # export cannot prove a named Dim's guards through the frame count's floordivs)
    named: bool = True

    def dynamic_shapes(self) -> tuple:
        low, high = self.low // self.step, self.high // self.step
        if self.named:
            steps = torch.export.Dim("length", min=low, max=high)
        else:
            steps = torch.export.Dim.DYNAMIC(min=low, max=high)
        length = steps if self.step == 1 else self.step * steps
        return tuple({axis: length for axis in axes} or None for axes in self.axes)

    def checked(self) -> tuple[int, ...]:
        """The bounds and two lengths strictly between them (when there are two), each a
        multiple of the step."""
        low, high = self.low // self.step, self.high // self.step
        span = high - low
        inside = {low + max(1, span // 3), low + max(1, (2 * span) // 3)}
        steps = {low, high} | {n for n in inside if n < high}
        return tuple(sorted(n * self.step for n in steps))


@dataclass
class Lowered:
    program: XnnpackProgram
    decisions: tuple[FoldDecision, ...]


def lower_with_decisions(
    module: torch.nn.Module,
    inputs: tuple,
    partitioners: Callable[[], Sequence],
    dynamic_shapes=None,
) -> Lowered:
    """Export `module` (with `dynamic_shapes` when given), lower it through etfold's
    entry point, planned for the declared bounds, and keep the decisions the lowering
    recorded."""
    program = torch.export.export(in_eval_mode(module), inputs, dynamic_shapes=dynamic_shapes)
    with collect_decisions() as decisions:
        lowered = lower_xnnpack(
            program, partitioners(), lower=to_edge_transform_and_lower, keep_declared_bounds=True
        )
    return Lowered(lowered, tuple(decisions))


@dataclass
class StaticDynamicPair:
    module: torch.nn.Module
    make_inputs: Callable[[int], tuple]
    length: LengthAxis
    static: Lowered
    dynamic: Lowered


def lower_static_and_dynamic(
    module: torch.nn.Module,
    make_inputs: Callable[[int], tuple],
    length: LengthAxis,
    partitioners: Callable[[], Sequence],
) -> StaticDynamicPair:
    """`module` exported at `length.traced` with a static and with a dynamic length."""
    module = in_eval_mode(module)
    inputs = make_inputs(length.traced)
    static = lower_with_decisions(module, inputs, partitioners)
    dynamic = lower_with_decisions(module, inputs, partitioners, length.dynamic_shapes())
    return StaticDynamicPair(module, make_inputs, length, static, dynamic)


def lower_xnnpack_pair(
    build: Callable[[], torch.nn.Module],
    make_inputs: Callable[[int], tuple],
    length: LengthAxis,
) -> StaticDynamicPair:
    """`build()`'s module, its weights drawn after `torch.manual_seed(0)`, lowered as a
    pair with etfold's XnnpackPartitioner: the tests' pairs are reproducible."""
    torch.manual_seed(0)
    return lower_static_and_dynamic(build(), make_inputs, length, lambda: [XnnpackPartitioner()])


def _compared(decisions: Iterable[FoldDecision], folds: Callable[[str], bool]) -> Counter:
    """(fold, applied, the reason when declined) of `folds`' decisions; those declined
    for the dynamic shape itself left out."""
    return Counter(
        (d.fold, d.applied, "" if d.applied else d.detail)
        for d in decisions
        if folds(d.fold) and not (not d.applied and d.detail.startswith(DYNAMIC_SHAPE_REASON))
    )


def decisions_apart(
    pair: StaticDynamicPair, folds: Callable[[str], bool]
) -> tuple[Counter, Counter]:
    """(only the static lowering's, only the dynamic lowering's) decisions of `folds`."""
    static = _compared(pair.static.decisions, folds)
    dynamic = _compared(pair.dynamic.decisions, folds)
    return static - dynamic, dynamic - static


def dynamic_errors(pair: StaticDynamicPair) -> dict[int, float]:
    """The dynamic program's largest error against eager at each checked length."""
    from etfold.harness.xnnpack_runner import max_abs_error

    errors = {}
    for length in pair.length.checked():
        inputs = pair.make_inputs(length)
        expected = eager_outputs(pair.module, inputs)
        errors[length] = max_abs_error(pair.dynamic.program.run(*inputs), expected)
    return errors


def assert_dynamic_matches_eager(pair: StaticDynamicPair, atol: float = 1e-5) -> None:
    """The dynamic program matches eager within `atol` at each checked length, its
    bounds among them."""
    errors = dynamic_errors(pair)
    bounds = {pair.length.low, pair.length.high}
    assert bounds <= set(errors) and max(errors.values()) <= atol, errors
