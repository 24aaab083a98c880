# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A conv whose last outputs are cut (wav2vec2's positional conv) pads less at the end
instead: on a dynamic time axis the cut no longer splits the delegate."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack._passes.conv_tail_slices_as_padding_pass import (
    FOLD,
    conv_tail_slices_as_padding,
)
from etfold.decisions import collect_decisions
from etfold.harness.dynamic_pairs import (
    LengthAxis,
    assert_dynamic_matches_eager,
    decisions_apart,
    lower_xnnpack_pair,
)

FRAMES = LengthAxis(((2,),), 4, 40, 9)


def frames(length: int) -> tuple[torch.Tensor]:
    generator = torch.Generator().manual_seed(length)
    return (torch.randn(1, 8, length, generator=generator),)


class SamePad(torch.nn.Module):
    """An even-kernel conv padded on both ends, its last output cut (transformers'
    wav2vec2 positional embedding), between two linears."""

    def __init__(self, kernel: int = 4, cut: int = 1, padding: int | None = None, reread=False):
        super().__init__()
        self.cut, self.reread = cut, reread
        padding = kernel // 2 if padding is None else padding
        self.conv = torch.nn.Conv1d(8, 8, kernel, padding=padding, groups=2)
        self.before, self.after = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.before(x.transpose(1, 2)).transpose(1, 2)
        full = self.conv(y)
        z = torch.nn.functional.gelu(full[:, :, : -self.cut])
        out = self.after(z.transpose(1, 2))
        return (out, full) if self.reread else out


@functools.cache
def _pair():
    return lower_xnnpack_pair(SamePad, frames, FRAMES)


def test_a_dynamic_cut_conv_is_one_delegate_like_the_static_one():
    pair = _pair()
    static_only, dynamic_only = decisions_apart(pair, lambda fold: fold == FOLD)
    assert not static_only and not dynamic_only
    assert Counter(d.applied for d in pair.dynamic.decisions if d.fold == FOLD) == {True: 1}
    assert pair.dynamic.program.delegates() == pair.static.program.delegates() == 1
    outside = pair.dynamic.program.ops_outside()
    assert "aten.slice_copy.Tensor" not in outside, outside
    assert_dynamic_matches_eager(pair)


def _export(module: torch.nn.Module, length: LengthAxis = FRAMES):
    return torch.export.export(
        module.eval(), frames(length.traced), dynamic_shapes=length.dynamic_shapes()
    )


@pytest.mark.parametrize(
    ("reason", "module"),
    [
        ("short of the 3 the cut drops", SamePad(kernel=4, cut=3, padding=2)),
        ("something else reads the conv's whole output", SamePad(reread=True)),
    ],
)
def test_declines_when(reason, module):
    program = _export(module)
    code = program.graph_module.code
    with collect_decisions() as decisions:
        assert conv_tail_slices_as_padding(program) is program
    assert program.graph_module.code == code
    (declined,) = [d for d in decisions if d.fold == FOLD]
    assert not declined.applied and reason in declined.detail, declined


class Cut2d(torch.nn.Module):
    def __init__(self, kernel, stride, padding, dilation, cut, dim):
        super().__init__()
        self.cut, self.dim = cut, dim
        self.conv = torch.nn.Conv2d(3, 4, kernel, stride, padding, dilation)

    def forward(self, x):
        y = self.conv(x)
        kept = [slice(None)] * y.dim()
        kept[self.dim] = slice(0, y.shape[self.dim] - self.cut)
        return y[tuple(kept)]


@settings(max_examples=25, deadline=None)
@given(
    kernel=st.integers(1, 4),
    stride=st.integers(1, 3),
    padding=st.integers(0, 4),
    dilation=st.integers(1, 2),
    cut=st.integers(1, 3),
    dim=st.sampled_from([2, 3]),
)
def test_generated_cut_convs_pad_less_exactly_when_the_padding_covers_the_cut(
    kernel, stride, padding, dilation, cut, dim
):
    torch.manual_seed(0)
    module = Cut2d(kernel, stride, padding, dilation, cut, dim).eval()
    x = torch.randn(1, 3, 13, 11)
    span = dilation * (kernel - 1) + 1
    outputs = (x.shape[dim] + 2 * padding - span) // stride + 1
    if outputs <= cut:
        return  # nothing would be left
    program = torch.export.export(module, (x,))
    with collect_decisions() as decisions:
        rewritten = conv_tail_slices_as_padding(program)
    (decision,) = [d for d in decisions if d.fold == FOLD]
    assert decision.applied == (padding >= cut * stride), decision
    assert (rewritten is program) != decision.applied
    torch.testing.assert_close(rewritten.module()(x), module(x), rtol=1e-6, atol=1e-6)
