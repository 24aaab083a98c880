# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Time two (or more) callables interleaved in one process, for a time budget.

A round calls every callable `inner` times, one call of each in turn, and each
call is timed on its own; the order of a turn cycles through every rotation of the
names and its reverse, across rounds as within one, so no callable always runs
right after another (one call per round included); a sample is a
callable's median call over the round (a call preempted by another process
does not move it). So drift (clock boost, cache state, other
processes) hits all of them alike, within a round as across rounds. `inner`
is chosen after warm-up so that a round lasts about `sample_s` per callable. Rounds continue
until `budget_s` is spent and at least `min_rounds` are taken.

The ratio of two callables is taken per round (b_i / a_i), so its spread is
the spread of paired measurements; two identical programs read ~1.00x.

A name may map to several callables: instances of the same program (loaded
several times). Round r uses instance r mod n. Two loads of one program can
differ by a few percent for as long as they live (where their buffers landed);
rotating instances puts that into the spread instead of into the median.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Spread:
    """Median and p10–p90 of a list of samples."""

    median: float
    p10: float
    p90: float
    samples: int

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if not values:
            raise ValueError("no samples")
        return cls(
            statistics.median(values), _percentile(values, 10), _percentile(values, 90), len(values)
        )


@dataclass(frozen=True)
class InterleavedTiming:
    milliseconds: dict[str, Spread]  # per callable, per call
    ratios: dict[tuple[str, str], Spread]  # (a, b) -> b / a per round
    rounds: int
    inner: int  # calls per sample


Runs = Mapping[str, Callable[[], object] | Sequence[Callable[[], object]]]


def _instances(runs: Runs) -> dict[str, list[Callable[[], object]]]:
    return {name: [r] if callable(r) else list(r) for name, r in runs.items()}


def _calls_per_sample(runs: Mapping[str, Callable[[], object]], sample_s: float) -> int:
    """Calls per round so that the slowest callable spends about `sample_s` in a round."""
    slowest = 0.0
    for run in runs.values():
        calls = []
        for _ in range(5):
            start = time.perf_counter()
            run()
            calls.append(time.perf_counter() - start)
        slowest = max(slowest, statistics.median(calls))
    return max(1, min(10_000, round(sample_s / max(slowest, 1e-9))))


def call_order(names: Sequence[str], turn: int) -> list[str]:
    """The order of the `turn`-th turn: rotation `turn` mod n of the names, reversed on
    every other pass through the rotations: over 2n turns each name runs in each place
    twice (for two or three names, every order comes up)."""
    shift = turn % len(names)
    order = [*names[shift:], *names[:shift]]
    return order[::-1] if (turn // len(names)) % 2 else order


def _one_round(
    runs: Mapping[str, Callable[[], object]], names: list[str], inner: int, first_turn: int
):
    """Each callable's median call time (seconds) over `inner` calls, the calls interleaved
    one by one (order from `call_order`), so every callable's sample covers the same
    stretch of time; the median keeps a call preempted by another process from moving
    the sample."""
    times: dict[str, list[float]] = {name: [] for name in names}
    clock = time.perf_counter
    for call in range(inner):
        for name in call_order(names, first_turn + call):
            run = runs[name]
            start = clock()
            run()
            times[name].append(clock() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def time_interleaved(
    runs: Runs,
    *,
    budget_s: float = 1.0,
    min_rounds: int = 10,
    warmup: int = 3,
    sample_s: float = 5e-3,
) -> InterleavedTiming:
    """Per-call times of each callable and the per-round ratio of each pair (later / earlier)."""
    if min_rounds < 1:
        raise ValueError("min_rounds must be at least 1")
    instances = _instances(runs)
    names = list(instances)
    for _ in range(warmup):
        for name in names:
            for run in instances[name]:
                run()
    inner = _calls_per_sample({name: i[0] for name, i in instances.items()}, sample_s)
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        deadline = time.perf_counter() + budget_s
        rounds = 0
        while rounds < min_rounds or time.perf_counter() < deadline:
            chosen = {name: i[rounds % len(i)] for name, i in instances.items()}
            medians = _one_round(chosen, names, inner, rounds * inner)
            for name in names:
                samples[name].append(medians[name] * 1e3)
            rounds += 1
    finally:
        if gc_was_enabled:
            gc.enable()
    ratios = {
        (a, b): Spread.of([y / x for x, y in zip(samples[a], samples[b], strict=True)])
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }
    return InterleavedTiming(
        {name: Spread.of(values) for name, values in samples.items()}, ratios, rounds, inner
    )
