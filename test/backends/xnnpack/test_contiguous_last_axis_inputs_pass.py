# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Softmax, log_softmax and layer_norm of a channels-last tensor read a contiguous copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.contiguous_last_axis_inputs_pass import (
    FOLD,
    match_channels_last_normalization,
    read_last_axis_normalizations_contiguous,
)
from etfold.decisions import Declined, collect_decisions
from etfold.exir import to_edge_transform_and_lower as etfold_lower
from etfold.exir.passes.graph_walk import is_channels_last
from etfold.harness.dynamic_pairs import (
    LengthAxis,
    decisions_apart,
    dynamic_errors,
    lower_static_and_dynamic,
)
from etfold.harness.xnnpack_runner import lower_module_xnnpack, max_abs_error

OPS = {
    "softmax": lambda h: torch.softmax(h, -1),
    "log_softmax": lambda h: torch.log_softmax(h, -1),
    "layer_norm": lambda h: F.layer_norm(h, h.shape[-1:]),
    "layer_norm_hw": lambda h: F.layer_norm(h, h.shape[-2:]),
}


class ChannelsLastConvThen(torch.nn.Module):
    def __init__(self, op: str, channels_last: bool = True):
        super().__init__()
        self.op, self.channels_last = op, channels_last
        self.conv = torch.nn.Conv2d(4, 4, 1)

    def forward(self, x):
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        return OPS[self.op](self.conv(x.to(memory_format=layout)))


def _copies(program) -> int:
    return sum(n.target == torch.ops.aten._to_copy.default for n in program.graph.nodes)


@pytest.mark.parametrize("op", OPS)
def test_normalization_of_channels_last_delegate_output_is_right(op):
    torch.manual_seed(0)
    x = torch.randn(1, 4, 5, 6)
    with collect_decisions() as decisions:
        program, reference = lower_module_xnnpack(
            ChannelsLastConvThen(op).eval(), (x,), [XnnpackPartitioner()], lower=etfold_lower
        )
    assert max_abs_error(program.run(x), reference) <= 1e-5
    assert [d for d in decisions if d.fold == FOLD and d.applied]


def test_rewrite_inserts_a_copy_in_and_restores_the_layout_out():
    program = torch.export.export(
        ChannelsLastConvThen("layer_norm").eval(), (torch.randn(1, 4, 5, 6),)
    )
    before, code = _copies(program), program.graph_module.code
    original = next(n for n in program.graph.nodes if n.target == torch.ops.aten.layer_norm.default)
    restores = is_channels_last(original.meta["val"])
    rewritten = read_last_axis_normalizations_contiguous(program)
    assert rewritten is not program and program.graph_module.code == code  # the user's is untouched
    norm = next(n for n in rewritten.graph.nodes if n.target == torch.ops.aten.layer_norm.default)
    assert norm.args[0].target == torch.ops.aten._to_copy.default
    assert norm.args[0].kwargs["memory_format"] == torch.contiguous_format
    assert _copies(rewritten) == before + 1 + restores  # into contiguous, back where eager is
    assert match_channels_last_normalization(norm) is None  # idempotent


def test_leaves_contiguous_inputs_alone():
    program = torch.export.export(
        ChannelsLastConvThen("softmax", channels_last=False).eval(), (torch.randn(1, 4, 5, 6),)
    )
    code = program.graph_module.code
    with collect_decisions() as decisions:
        assert read_last_axis_normalizations_contiguous(program) is program
    assert program.graph_module.code == code and not decisions


def test_declines_when_input_has_no_metadata():
    program = torch.export.export(
        ChannelsLastConvThen("softmax").eval(), (torch.randn(1, 4, 5, 6),)
    )
    softmax = next(n for n in program.graph.nodes if "softmax" in str(n.target))
    del softmax.args[0].meta["val"]
    code = program.graph_module.code
    with collect_decisions() as decisions:
        read_last_axis_normalizations_contiguous(program)
    assert isinstance(match_channels_last_normalization(softmax), Declined)
    assert program.graph_module.code == code
    assert [d.detail for d in decisions if d.fold == FOLD and not d.applied] == [
        f"`{softmax.name}` has no tensor metadata on its input"
    ]


class NormOfChannelsLastInput(torch.nn.Module):
    """A layout copy straight into the normalization, then a bf16 round trip."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op

    def forward(self, x):
        h = OPS[self.op](x.to(memory_format=torch.channels_last).float())
        return h.to(torch.bfloat16, memory_format=torch.channels_last).float()


@pytest.mark.parametrize("op", ["layer_norm", "softmax"])
def test_a_layout_copy_of_a_contiguous_tensor_is_read_through_not_copied_back(op):
    torch.manual_seed(0)
    x = torch.randn(1, 3, 4, 6)
    program = torch.export.export(NormOfChannelsLastInput(op).eval(), (x,))
    rewritten = read_last_axis_normalizations_contiguous(program)
    norm = next(n for n in rewritten.graph.nodes if n.target == OPS_TARGETS[op])
    assert norm.args[0].op == "placeholder"  # x itself: no channels-last -> contiguous round trip
    lowered, reference = lower_module_xnnpack(
        NormOfChannelsLastInput(op).eval(),
        (x,),
        [XnnpackPartitioner(enable_bf16=True)],
        lower=etfold_lower,
    )
    assert max_abs_error(lowered.run(x), reference) <= 1e-2


OPS_TARGETS = {
    "layer_norm": torch.ops.aten.layer_norm.default,
    "softmax": torch.ops.aten.softmax.int,
}


# each op's copy in a static program above; a symbolic width, with layer norm in `make test`,
# with softmax in `make test-long`
@pytest.mark.parametrize("op", [pytest.param("softmax", marks=pytest.mark.long), "layer_norm"])
def test_a_dynamic_width_reads_the_same_copy_and_matches_eager_at_the_bounds(op):
    """The copies resize with the tensor: a symbolic width changes nothing."""
    torch.manual_seed(0)
    axis = LengthAxis(((3,),), 2, 16, 6)
    pair = lower_static_and_dynamic(
        ChannelsLastConvThen(op).eval(),
        lambda width: (
            torch.randn(1, 4, 5, width, generator=torch.Generator().manual_seed(width)),
        ),
        axis,
        lambda: [XnnpackPartitioner()],
    )
    assert decisions_apart(pair, lambda fold: fold == FOLD) == ({}, {})
    assert [d.applied for d in pair.dynamic.decisions if d.fold == FOLD] == [True]
    assert pair.dynamic.program.delegates() == pair.static.program.delegates()
    assert pair.dynamic.program.ops_outside() == pair.static.program.ops_outside()
    errors = dynamic_errors(pair)
    assert {axis.low, axis.high} <= set(errors) and max(errors.values()) <= 1e-5, errors
