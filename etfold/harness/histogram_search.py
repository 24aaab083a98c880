# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""HistogramObserver's min/max search, the same walk over numbers instead of tensors.

The Arm quantizer observes every activation with torchao's `HistogramObserver`,
whose qparam search walks the cumulative histogram in steps of 1e-5 of its mass,
indexing a tensor element and comparing it with a Python float at every step:
about 90 ms per observer, a tenth of an INT test's time. Inside
`histogram_search_on_numbers()` the walk reads the cumulative sums as float32
numbers and compares them with the bound rounded to float32, which is what
torch's tensor-scalar comparison does, and calls the observer's own error
measure: the chosen min/max are the ones torchao chooses. Runs of steps that
move no bound (most of them) are taken a chunk at a time. It undoes itself on
exit and acts only in the context that entered it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from etfold.exir.program.reentrant_patch import ReentrantPatch, Replacement

STEP = 1e-5  # the search's quantile granularity, as torchao walks it
_STALL_CHUNK = 4096
_ATTRIBUTE = "_non_linear_param_search"


def _bounds_inward(cumulative, start: int, end: int, low: float, high: float) -> tuple[int, int]:
    """The first bin at or past the `low` mass and the last at or before the `high` mass,
    looked for between the current bounds (float32 comparisons, as torch makes them)."""
    low_mass, high_mass = np.float32(low), np.float32(high)
    left, right = start, end
    while left < end and cumulative[left] < low_mass:
        left += 1
    while right > start and cumulative[right] > high_mass:
        right -= 1
    return left, right


def _high_after_stalled_steps(top, low_quantile: float, high_quantile: float, total: float):
    """The high quantile at the walk's next step that moves a bound or ends the walk.

    While no bound moves, a step only lowers the high quantile by STEP (the low
    one stays, so the low bound does too): the walk's own sequence of roundings,
    taken a chunk at a time (`cumsum` adds in order), instead of one Python step
    each. `top` is the cumulative mass at the upper bound (None: it cannot move).
    """
    while True:
        steps = np.full(_STALL_CHUNK + 1, -STEP)
        steps[0] = high_quantile
        highs = np.cumsum(steps)  # highs[i]: the high quantile as step i begins
        ends = ~(low_quantile < highs[:-1])
        moves = np.zeros(_STALL_CHUNK, bool) if top is None else top > _masses(highs[1:], total)
        stop = np.flatnonzero(ends | moves)
        if stop.size:
            return float(highs[stop[0]])
        high_quantile = float(highs[-1])


def _masses(quantiles, total: float):
    """`np.float32(q * total)` for each quantile: a double product rounded once to float32."""
    return (quantiles * total).astype(np.float32)


def search_min_max(observer) -> tuple[torch.Tensor, torch.Tensor]:
    """The min/max `observer._non_linear_param_search()` returns: move whichever bound
    gains more bins per step, until the L2 quantization error stops falling."""
    total = torch.sum(observer.histogram).item()
    cumulative = torch.cumsum(observer.histogram, dim=0).numpy()
    low_quantile, high_quantile = 0.0, 1.0
    start, end = 0, observer.bins - 1
    least_error = float("inf")
    while low_quantile < high_quantile:
        low, high = low_quantile + STEP, high_quantile - STEP
        left, right = _bounds_inward(cumulative, start, end, low * total, high * total)
        next_start, next_end = start, end
        if left - start > end - right:
            next_start, low_quantile = left, low
        else:
            next_end, high_quantile = right, high
        if (next_start, next_end) == (start, end):
            high_quantile = _high_after_stalled_steps(
                cumulative[end] if end > start else None, low_quantile, high_quantile, total
            )
            continue
        error = observer._compute_quantization_error(next_start, next_end)
        if error > least_error:
            break
        least_error, start, end = error, next_start, next_end
    bin_width = (observer.max_val - observer.min_val) / observer.bins
    return observer.min_val + bin_width * start, observer.min_val + bin_width * (end + 1)


def _observer_class():
    from torchao.quantization.pt2e.observer import HistogramObserver

    return HistogramObserver


def _replacements() -> list[Replacement]:
    return [Replacement(_observer_class(), _ATTRIBUTE, lambda search: search_min_max)]


_PATCH = ReentrantPatch("histogram_search_on_numbers", _replacements)


@contextlib.contextmanager
def histogram_search_on_numbers() -> Iterator[None]:
    """torchao's HistogramObserver searches its min/max on numbers inside this scope."""
    with _PATCH.scope():
        yield
