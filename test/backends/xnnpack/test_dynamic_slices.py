# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Slices on a dynamic sequence (rotary halves) run inside the delegate and resize at runtime."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from executorch.backends.xnnpack.operators import node_visitor

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack.operators.op_dynamic_slice import (
    SLICE_TARGET,
    UpstreamSliceVisitor,
)
from etfold.backends.xnnpack.partition.config.dynamic_slice_config import FOLD
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.dynamic_shapes import lower_dynamic


class RotateHalf(torch.nn.Module):
    """HF Llama's rotary embedding on [1, H, T, D]: halves of the last dim, swapped."""

    def forward(self, x, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def _inputs(tokens: int) -> tuple:
    gen = torch.Generator().manual_seed(tokens)
    shapes = [(1, 4, tokens, 8), (tokens, 8), (tokens, 8)]
    return tuple(torch.randn(shape, generator=gen) for shape in shapes)


@functools.cache
def _lowered(dynamic: bool):
    tokens = torch.export.Dim("tokens", min=2, max=32)
    dims = ({2: tokens}, {0: tokens}, {0: tokens}) if dynamic else None
    program, decisions = lower_dynamic(
        RotateHalf(), _inputs(5), dims, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
    )
    return program, decisions


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_rotary_halves_join_the_delegate(dynamic):
    program, decisions = _lowered(dynamic)
    assert program.delegates() == 1 and not program.ops_outside()
    assert not [d for d in decisions if d.fold == FOLD]


@pytest.mark.parametrize("tokens", [2, 17, 32], ids=["min", "between", "max"])
def test_dynamic_rotary_halves_resize_bit_for_bit(tokens):
    program, _ = _lowered(True)
    inputs = _inputs(tokens)
    (actual,) = program.run(*inputs)
    assert torch.equal(actual, RotateHalf()(*inputs))


def test_upstreams_slice_visitor_is_back_after_the_lowering():
    _lowered(True)
    assert node_visitor._node_visitor_dict[SLICE_TARGET] is UpstreamSliceVisitor


class TableReadToLength(torch.nn.Module):
    """A rotary table read up to the sequence length: a slice along the dynamic dim."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(64, 8))

    def forward(self, x):
        return x * self.table[: x.shape[0]]


def test_declines_a_slice_along_the_dynamic_dim_naming_it():
    torch.manual_seed(0)
    module = TableReadToLength()
    tokens = torch.export.Dim("tokens", min=2, max=32)
    program, decisions = lower_dynamic(
        module,
        (torch.randn(5, 8),),
        ({0: tokens},),
        [XnnpackPartitioner()],
        lower=to_edge_transform_and_lower,
    )
    assert program.ops_outside()["aten.slice_copy.Tensor"] == 1
    (reason,) = {d.detail for d in decisions if d.fold == FOLD}
    assert re.fullmatch(
        r"dynamic shape: slices dim 0 \(s\d+ in 2\.\.32\), whose bounds change with the "
        r"input; XNNPACK's slice infers only whole dims",
        reason,
    )
    for rows in (2, 32):
        x = torch.randn(rows, 8)
        (actual,) = program.run(x)
        assert torch.equal(actual, module(x))
