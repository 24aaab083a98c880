# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A value computed from constants and sizes, at every size its bounds allow: what
`known_at_every_size` gives, and what `reads_user_values` says of the nodes it reads."""

from __future__ import annotations

import torch

from etfold.backends.xnnpack._passes.mask_at_every_size import (
    known_at_every_size,
    reads_user_values,
)
from etfold.decisions import Declined
from etfold.exir.passes.graph_walk import state_facts
from etfold.exir.program.lower import mark_for_lowering


class Positions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("offset", torch.tensor(3))

    def forward(self, x, keep):
        from_size = torch.arange(x.shape[1]) + self.offset  # sizes and a buffer
        constant = torch.arange(4) * 2  # no size at all
        from_values = keep + 1  # the user's values
        return x.sum() + from_size.sum() + constant.sum() + from_values.sum()


def _program(marked: bool = True):
    length = torch.export.Dim("length", min=2, max=9)
    inputs = (torch.randn(1, 5), torch.ones(5, dtype=torch.long))
    program = torch.export.export(Positions(), inputs, dynamic_shapes=({1: length}, {0: length}))
    if marked:
        mark_for_lowering({"forward": program})  # as etfold's entry point marks its copy
    return program, {node.name: node for node in program.graph.nodes}


def test_a_value_from_sizes_is_computed_at_each_size():
    program, nodes = _program()
    found = known_at_every_size(program, nodes["add"], state_facts(program))
    assert [next(iter(at.values())) for at, _ in found] == list(range(2, 10))
    assert all(torch.equal(value, torch.arange(len(value)) + 3) for _, value in found)


def test_a_value_from_constants_is_computed_once():
    program, nodes = _program()
    (only,) = known_at_every_size(program, nodes["mul"], state_facts(program))
    assert only[0] == {} and torch.equal(only[1], torch.arange(4) * 2)


def test_a_user_inputs_values_are_not_known():
    program, nodes = _program()
    found = known_at_every_size(program, nodes["add_1"], state_facts(program))
    assert found == Declined("`add_1` reads the values of user input keep")
    assert reads_user_values(nodes["add_1"], program)
    assert reads_user_values(nodes["keep"], program)
    # the arange reads x's size, not its values
    assert not reads_user_values(nodes["add"], program)
    assert not reads_user_values(nodes["mul"], program)


def test_a_buffer_no_lowering_judged_is_not_known():
    program, nodes = _program(marked=False)
    found = known_at_every_size(program, nodes["add"], state_facts(program))
    assert isinstance(found, Declined) and "was not judged across methods" in found.reason
