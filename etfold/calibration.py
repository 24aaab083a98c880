# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Calibration inputs for a user's program on an integer (Arm) target.

From a `.pt` file of input tuples (`torch.save([(x1, ...), ...], path)`), or
random inputs shaped like the example inputs. Random inputs make the
quantization ranges, and so any error measured with them, say nothing about
real data; whoever uses them says so (`RANDOM_CALIBRATION_WARNING`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from etfold.exir.passes.node_shapes import node_value
from etfold.report import UserInputError

RANDOM_CALIBRATION_WARNING = (
    "calibrating on {count} random inputs shaped like the example inputs: the quantization "
    "ranges, and any error measured with them, say nothing about real data "
    "(give --calibration FILE, a .pt list of input tuples)"
)


def _inputs_text(inputs: Sequence) -> str:
    return ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in inputs)


def input_shapes(program) -> list[tuple[int | None, ...]]:
    """Each user input's sizes, None where the program leaves a size symbolic."""
    names = set(program.graph_signature.user_inputs)
    shapes = []
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in names:
            sizes = getattr(node_value(node), "shape", ())
            shapes.append(tuple(s if isinstance(s, int) else None for s in sizes))
    return shapes


def _fits(sample: Sequence, example_inputs: Sequence, shapes: Sequence) -> bool:
    if len(sample) != len(example_inputs):
        return False
    for tensor, example, sizes in zip(sample, example_inputs, shapes, strict=False):
        if tensor.dtype != example.dtype or tensor.dim() != example.dim():
            return False
        if any(s is not None and s != t for s, t in zip(sizes, tensor.shape, strict=False)):
            return False
    return True


def check_calibration(
    samples, example_inputs: Sequence, source: str, shapes: Sequence = ()
) -> list[tuple]:
    """Calibration samples as a list of input tuples, each matching the example inputs'
    count, dtypes and ranks, and their sizes where `shapes` (`input_shapes`) fixes them."""
    import torch

    if isinstance(samples, torch.Tensor):
        samples = [samples]
    if not isinstance(samples, list | tuple) or not samples:
        raise UserInputError(f"{source}: expected a non-empty list of input tuples")
    checked = []
    for index, sample in enumerate(samples):
        sample = (sample,) if isinstance(sample, torch.Tensor) else sample
        if not isinstance(sample, list | tuple) or not all(
            isinstance(t, torch.Tensor) for t in sample
        ):
            raise UserInputError(f"{source}: sample {index} is not a tuple of tensors")
        if not _fits(sample, example_inputs, shapes or [()] * len(example_inputs)):
            raise UserInputError(
                f"{source}: sample {index} is ({_inputs_text(sample)}); "
                f"the program takes ({_inputs_text(example_inputs)})"
            )
        checked.append(tuple(sample))
    return checked


def load_calibration(path: str, example_inputs: Sequence, shapes: Sequence = ()) -> list[tuple]:
    """The input tuples saved in `path` (`torch.save([(x1, ...), ...], path)`)."""
    import torch

    try:
        samples = torch.load(path, weights_only=True)
    except Exception as error:
        message = " ".join(str(error).split())[:200]
        raise UserInputError(
            f"{path}: cannot read calibration data ({type(error).__name__}: {message})"
        ) from error
    return check_calibration(samples, example_inputs, path, shapes)


def random_calibration(example_inputs: Sequence, count: int, seed: int = 0) -> list[tuple]:
    """`count` input tuples: floating inputs drawn from N(0, 1) in the example's shape and
    dtype, other inputs (indices, masks) repeated from the example."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def draw(example):
        if not example.dtype.is_floating_point:
            return example.clone()
        sample = torch.randn(example.shape, generator=generator, dtype=torch.float32)
        return sample.to(example.dtype)

    return [tuple(draw(e) for e in example_inputs) for _ in range(count)]


@dataclass(frozen=True)
class CalibrationSource:
    """Where a lowering's calibration samples come from: a file, else `random_count`
    random inputs (none: the example inputs alone)."""

    path: str | None = None
    random_count: int = 0

    def samples(self, program) -> list[tuple]:
        """The samples for `program` (an ExportedProgram with positional example inputs)."""
        args, _ = program.example_inputs
        if self.path is not None:
            return load_calibration(self.path, tuple(args), input_shapes(program))
        return random_calibration(tuple(args), self.random_count)
