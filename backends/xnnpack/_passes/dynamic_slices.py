# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""When XNNPACK's static slice resizes at runtime: the one answer for the split pass, the
partitioner config and the visitor.

    y = slice(x, d, start, end)     x: [.., s, .., n_d, ..], s symbolic, n_d static
      -> XNNPACK static slice, offsets [0, .., start, ..], sizes [.., 0, .., end - start, ..]

XNNPACK's static slice takes a size of 0 at offset 0 as "the whole dim, whatever it
is when the runtime resizes the graph" (measured on the executorch 1.5.1 runtime:
[1, s, 8] sliced along its last dim, s = 2, 7, 16, bit for bit eager's). So a
slice along a static dim of a tensor whose other dims are dynamic runs inside the
delegate: each symbolic dim is kept whole (its size in the output provably the
input's), and the sliced dim, start and end are known when lowering. A slice along
the symbolic dim itself (a rotary table read up to the sequence length) is not: its
bounds change with the input.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from etfold.decisions import Declined
from etfold.exir.passes.graph_walk import describe_axes, sizes_known_equal, symbolic_axes
from etfold.exir.passes.node_shapes import node_value


def is_dynamic(value: object) -> bool:
    return bool(symbolic_axes(value))


def slice_resizes_at_runtime(
    source: torch.Tensor, out: torch.Tensor, dim: int, start: object, end: object
) -> Declined | None:
    """None when a slice of `source` along `dim` giving `out` keeps every symbolic dim
    whole and is known along `dim`; else why XNNPACK cannot run it dynamically."""
    dim %= source.dim()
    symbolic = symbolic_axes(source)
    if dim in symbolic or dim in symbolic_axes(out):
        dynamic = source if dim in symbolic else out
        return Declined(
            f"dynamic shape: slices {describe_axes(dynamic, [dim])}, whose bounds change "
            "with the input; XNNPACK's slice infers only whole dims"
        )
    if type(start) is not int or type(end) is not int:
        return Declined(f"slice bounds {start}..{end} are not known when lowering")
    for axis in symbolic:
        if not sizes_known_equal(source.shape[axis], out.shape[axis]):
            return Declined(f"dynamic shape: {describe_axes(source, [axis])} is not kept whole")
    if any(type(s) is int and s == 0 for s in (*source.shape, *out.shape)):
        return Declined("an empty tensor: XNNPACK takes no empty tensors")
    return None


class SliceArguments(NamedTuple):
    dim: int
    start: object  # an int, or a symbolic size
    end: object  # None: to the end of the dim
    step: int


def slice_arguments(node: torch.fx.Node) -> SliceArguments:
    """A `slice(x, dim=0, start=None, end=None, step=1)` node's arguments, the schema's
    defaults filled in and a missing start read as 0."""
    given, defaults = tuple(node.args[1:]), (0, None, None, 1)
    dim, start, end, step = given + defaults[len(given) :]
    return SliceArguments(dim, 0 if start is None else start, end, step)


def dynamic_slice_declined(node: torch.fx.Node) -> Declined | None:
    """`slice_resizes_at_runtime` for a `slice(x, dim, start, end, step)` node (step 1)."""
    source, out = node_value(node.args[0]), node_value(node)
    if not isinstance(source, torch.Tensor) or not isinstance(out, torch.Tensor):
        return Declined("no tensor metadata on the slice or its input")
    dim, start, end, step = slice_arguments(node)
    if step != 1:
        return Declined(f"step {step}: XNNPACK slices with step 1")
    end = source.shape[dim] if end is None else end
    return slice_resizes_at_runtime(source, out, dim, start, end)
