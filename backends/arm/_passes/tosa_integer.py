# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""TOSA-1.0 integer arithmetic, evaluated exactly on the host.

The one place etfold computes what a TOSA INT graph computes:

    RESCALE (SINGLE_ROUND, 32-bit multiplier):
        v = x - input_zp
        r = (v * multiplier + 2**(shift - 1)) >> shift      (arithmetic shift, int64)
        y = clamp(r + output_zp, out_dtype)
    MUL int32 (shift 0):  y = a * b     (must stay in int32)
    ADD int32:            y = a + b     (must stay in int32)

and the exact integer affine fit the DyT folds rely on:

    given distinct x[n] and y[n, c], find integers a[c], b[c] with
    y[n, c] == a[c] * x[n] + b[c] for every n, or report channel c as not affine.

`multiplier_and_shift` reproduces the encoding the Arm backend serializes for a
float scale; `test_tosa_integer.py` pins it against the backend and checks
`Rescale.apply` bit for bit against `tosa_reference_model`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1

_MULTIPLIER_BITS = 31  # 32-bit signed multiplier: mantissa scaled to [2**30, 2**31)
_BLOCK = 16384  # elements per block in the affine fit: half torch's intra-op grain size
_MIN_SHIFT = 2
_MAX_SHIFT = 62


def multiplier_and_shift(scale: float) -> tuple[int, int]:
    """Encode `scale` as (multiplier, shift) with scale ~= multiplier / 2**shift.

    Matches the Arm backend's encoding exactly, including Python's
    round-half-even on the mantissa and the clamp of very small scales to
    shift 62 (the multiplier absorbs the difference).
    """
    if not math.isfinite(scale) or scale < 0:
        raise ValueError(f"RESCALE scale must be finite and non-negative, got {scale}")
    mantissa, exponent = math.frexp(scale)
    multiplier = round(mantissa * (1 << _MULTIPLIER_BITS))
    if multiplier == 1 << _MULTIPLIER_BITS:  # mantissa rounded up to 1.0
        multiplier >>= 1
        exponent += 1
    shift = _MULTIPLIER_BITS - exponent
    if shift > _MAX_SHIFT:
        multiplier >>= min(_MULTIPLIER_BITS, shift - _MAX_SHIFT)
        shift = _MAX_SHIFT
    if not _MIN_SHIFT <= shift <= _MAX_SHIFT:
        raise ValueError(f"scale {scale} needs shift {shift}, outside [{_MIN_SHIFT}, {_MAX_SHIFT}]")
    return multiplier, shift


def dtype_range(dtype: torch.dtype) -> tuple[int, int]:
    info = torch.iinfo(dtype)
    return int(info.min), int(info.max)


def fits_int32(values: torch.Tensor) -> bool:
    if values.numel() == 0:
        return True
    return int(values.min()) >= INT32_MIN and int(values.max()) <= INT32_MAX


@dataclass(frozen=True)
class Rescale:
    """One per-tensor TOSA RESCALE, SINGLE_ROUND, signed input and output."""

    scale: float
    input_zp: int
    output_zp: int
    output_dtype: torch.dtype

    @property
    def encoding(self) -> tuple[int, int]:
        return multiplier_and_shift(self.scale)

    def in_range(self, values: torch.Tensor) -> bool:
        """TOSA's REQUIRE on apply_scale_32: the centered input and the scaled result."""
        multiplier, shift = self.encoding
        centered = values.to(torch.int64) - self.input_zp
        bound = 1 << (shift - 1)
        if centered.numel() and (int(centered.min()) < -bound or int(centered.max()) >= bound):
            return False
        return fits_int32(self._scaled(centered, multiplier, shift))

    def apply(self, values: torch.Tensor) -> torch.Tensor:
        """The RESCALE of integer `values` (any shape), as int64, clamped to the output dtype."""
        multiplier, shift = self.encoding
        centered = values.to(torch.int64) - self.input_zp
        low, high = dtype_range(self.output_dtype)
        return (self._scaled(centered, multiplier, shift) + self.output_zp).clamp(low, high)

    @staticmethod
    def _scaled(centered: torch.Tensor, multiplier: int, shift: int) -> torch.Tensor:
        # |centered| < 2**33 and multiplier < 2**31, so the product fits int64.
        return (centered * multiplier + (1 << (shift - 1))) >> shift


@dataclass(frozen=True)
class AffineFit:
    """Per channel: slope a, offset b, and whether y == a * x + b holds exactly."""

    slopes: torch.Tensor  # int64 [C]
    offsets: torch.Tensor  # int64 [C]
    exact: torch.Tensor  # bool [C]

    @property
    def all_exact(self) -> bool:
        return bool(self.exact.all())


def fit_exact_integer_affine(x: torch.Tensor, y: torch.Tensor) -> AffineFit:
    """Fit y[:, c] == a[c] * x + b[c] over integers, all channels at once.

    `x` holds n distinct integers, `y` is [n, C]. With one point the fit is the
    constant (a = 0, b = y). Otherwise the first two points fix a and b; a
    channel is exact when the slope divides and every point lies on the line.
    """
    if x.dim() != 1 or y.dim() != 2 or y.shape[0] != x.shape[0] or x.numel() == 0:
        raise ValueError(
            f"expected x[n] and y[n, C] with n >= 1, got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    x = x.to(torch.int64)
    y = y.to(torch.int64)
    if torch.unique(x).numel() != x.numel():
        raise ValueError("x must hold distinct values")
    if x.numel() == 1:
        slopes = torch.zeros(y.shape[1], dtype=torch.int64)
        return AffineFit(slopes, y[0].clone(), torch.ones(y.shape[1], dtype=torch.bool))
    dx = x[1] - x[0]
    dy = y[1] - y[0]
    divides = torch.remainder(dy, dx) == 0
    slopes = torch.where(divides, torch.div(dy, dx, rounding_mode="floor"), torch.zeros_like(dy))
    offsets = y[0] - slopes * x[0]
    on_line = torch.empty_like(divides)
    # Column blocks of at most _BLOCK elements: every op stays under torch's
    # parallel grain size and runs on the calling thread (waking the intra-op
    # pool costs far more than this work on a busy host). eq_ keeps int64, and
    # amin over it is the cheap "all".
    step = max(1, _BLOCK // x.numel())
    for start in range(0, y.shape[1], step):
        stop = start + step
        line = x[:, None] * slopes[None, start:stop]
        line.add_(offsets[None, start:stop])
        on_line[start:stop] = line.eq_(y[:, start:stop]).amin(dim=0) == 1
    return AffineFit(slopes, offsets, divides & on_line)
