# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""etfold's TOSA integer arithmetic against the Arm backend's encoding and tosa_reference_model."""

import numpy as np
import pytest
import torch
import tosa_reference_model
import tosa_serializer as ts
from executorch.backends.arm.operators.op_tosa_rescale import _compute_multiplier_and_shift

from etfold.backends.arm._passes.tosa_integer import (
    Rescale,
    fit_exact_integer_affine,
    multiplier_and_shift,
)

_DTYPES = {torch.int8: (ts.DType.INT8, np.int8), torch.int32: (ts.DType.INT32, np.int32)}


def _random_scales(count: int, seed: int) -> list[float]:
    generator = np.random.default_rng(seed)
    exponents = generator.uniform(-30, 18, size=count)
    return [float(2.0**e) for e in exponents] + [1.0, 0.5, 2.0**19, 1.0 / 255.0, 0.0]


def test_multiplier_and_shift_is_the_backend_encoding():
    scales = _random_scales(2000, seed=0)
    multipliers, shifts = _compute_multiplier_and_shift(scales)
    assert [multiplier_and_shift(s) for s in scales] == list(zip(multipliers, shifts, strict=True))


def _rescale_graph(shape, rescale: Rescale, input_dtype: torch.dtype) -> bytes:
    graph = ts.TosaSerializer("", targetMajor=1, targetMinor=0, targetPatch=0, targetDraft=False)
    in_type, out_type = _DTYPES[input_dtype][0], _DTYPES[rescale.output_dtype][0]
    block = graph.currRegion.currBasicBlock
    block.addTensor("x", list(shape), in_type)
    graph.addInputTensor(block.tensors["x"])
    output = graph.addOutput(list(shape), out_type)
    multiplier, shift = rescale.encoding
    graph.addConst([1], ts.DType.INT32, [multiplier], name="multiplier")
    graph.addConst([1], ts.DType.INT8, [shift], name="shift")
    graph.addConst([1], in_type, [rescale.input_zp], name="input_zp")
    graph.addConst([1], out_type, [rescale.output_zp], name="output_zp")
    attribute = ts.TosaSerializerAttribute()
    attribute.RescaleAttribute(
        scale32=True,
        rounding_mode=ts.RoundingMode.SINGLE_ROUND,
        per_channel=False,
        input_unsigned=False,
        output_unsigned=False,
    )
    graph.addOperator(
        ts.Op.RESCALE,
        ["x", "multiplier", "shift", "input_zp", "output_zp"],
        [output.name],
        attribute,
    )
    return graph.serialize()


def _reference(rescale: Rescale, values: np.ndarray, input_dtype: torch.dtype) -> np.ndarray:
    outputs, status = tosa_reference_model.run(
        _rescale_graph(values.shape, rescale, input_dtype), [values], verbosity="NONE"
    )
    assert status == tosa_reference_model.GraphStatus.TOSA_VALID
    return outputs[0]


@pytest.mark.parametrize("seed", range(6))
def test_rescale_int8_to_int32_matches_reference_model(seed):
    generator = np.random.default_rng(seed)
    values = np.arange(-128, 128, dtype=np.int8)
    for scale in generator.uniform(0.0, 1.0, size=3) * 2.0 ** generator.integers(-8, 20, size=3):
        rescale = Rescale(float(scale), int(generator.integers(-128, 128)), 0, torch.int32)
        expected = _reference(rescale, values, torch.int8)
        assert torch.equal(
            rescale.apply(torch.from_numpy(values)), torch.from_numpy(expected).long()
        )


@pytest.mark.parametrize("seed", range(6))
def test_rescale_int32_to_int8_matches_reference_model(seed):
    generator = np.random.default_rng(100 + seed)
    values = generator.integers(-(2**24), 2**24, size=4096, dtype=np.int32)
    values[:8] = [0, 1, -1, 2**23, -(2**23), 127, -128, 3]
    for scale in generator.uniform(0.0, 1.0, size=3) * 2.0 ** generator.integers(-24, 0, size=3):
        rescale = Rescale(float(scale), 0, int(generator.integers(-128, 128)), torch.int8)
        expected = _reference(rescale, values, torch.int32)
        assert torch.equal(
            rescale.apply(torch.from_numpy(values)), torch.from_numpy(expected).long()
        )


def test_rescale_rounds_half_up_like_single_round():
    half = Rescale(0.5, 0, 0, torch.int32)
    values = torch.tensor([-3, -1, 1, 3])
    expected = _reference(half, values.numpy().astype(np.int32), torch.int32)
    assert half.apply(values).tolist() == expected.tolist() == [-1, 0, 1, 2]


def _fit_by_loop(x, y):
    slopes, offsets, exact = [], [], []
    for c in range(y.shape[1]):
        points = list(zip(x.tolist(), y[:, c].tolist(), strict=True))
        if len(points) == 1:
            a, b = 0, points[0][1]
        else:
            (x0, y0), (x1, y1) = points[0], points[1]
            a = (y1 - y0) // (x1 - x0) if (y1 - y0) % (x1 - x0) == 0 else 0
            b = y0 - a * x0
        slopes.append(a)
        offsets.append(b)
        exact.append(
            all(yy == a * xx + b for xx, yy in points)
            and (len(points) == 1 or (y1 - y0) % (x1 - x0) == 0)
        )
    return slopes, offsets, exact


def test_fit_recovers_exact_lines_and_rejects_the_rest():
    generator = torch.Generator().manual_seed(0)
    x = torch.randperm(256, generator=generator)[:40] - 128
    slopes = torch.randint(-3, 4, (16,), generator=generator)
    offsets = torch.randint(-500, 500, (16,), generator=generator)
    y = x[:, None] * slopes[None, :] + offsets[None, :]
    y[5, 3] += 1  # one point off its line
    y[:, 7] = (x * 3) // 2  # rational slope
    fit = fit_exact_integer_affine(x, y)
    assert fit.exact.tolist() == [c not in (3, 7) for c in range(16)]
    good = fit.exact
    assert torch.equal(fit.slopes[good], slopes[good]) and torch.equal(
        fit.offsets[good], offsets[good]
    )
    assert (fit.slopes.tolist(), fit.offsets.tolist(), fit.exact.tolist()) == _fit_by_loop(x, y)


def test_fit_of_a_single_code_is_a_constant():
    fit = fit_exact_integer_affine(torch.tensor([5]), torch.tensor([[7, -3, 0]]))
    assert fit.slopes.tolist() == [0, 0, 0] and fit.offsets.tolist() == [7, -3, 0] and fit.all_exact


def test_fit_needs_distinct_codes():
    with pytest.raises(ValueError, match="distinct"):
        fit_exact_integer_affine(torch.tensor([1, 1]), torch.tensor([[1], [1]]))
