# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A value computed from constants and sizes, at every size its bounds allow: what
`known_at_every_size` gives (once per class of sizes giving it the same derived sizes:
frame counts of a sample count), and what `reads_user_values` says of the nodes it reads."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack._passes.mask_at_every_size import (
    MAX_SIZES,
    elements_source,
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


class FramePositions(torch.nn.Module):
    """Positions of the frames two strided convolutions make of `x`'s samples, built
    from the sample count alone: (L - 10) // 5 + 1, then (n - 3) // 2 + 1."""

    def forward(self, x):
        frames = ((x.shape[1] - 10) // 5 + 1 - 3) // 2 + 1
        positions = torch.arange(frames)[:, None] >= 0
        return x.sum() + positions.expand(frames, frames).sum()


def _frames(length: int) -> int:
    return ((length - 10) // 5 + 1 - 3) // 2 + 1


def _samples_program(low: int, high: int, marked: bool = True):
    samples = torch.export.Dim.DYNAMIC(min=low, max=high)  # torch cannot prove a named one
    program = torch.export.export(
        FramePositions(), (torch.randn(1, low + 50),), dynamic_shapes=({1: samples},)
    )
    if marked:
        mark_for_lowering({"forward": program})
    nodes = {node.name: node for node in program.graph.nodes}
    return program, nodes


def _the_compare(nodes: dict) -> torch.fx.Node:
    (compare,) = (n for n in nodes.values() if n.target is torch.ops.aten.ge.Scalar)
    return compare


def test_a_value_of_frame_counts_is_computed_once_per_frame_count():
    program, nodes = _samples_program(100, 20000)  # 19901 lengths, over MAX_SIZES
    assert MAX_SIZES < 20000 - 100 + 1
    found = known_at_every_size(program, _the_compare(nodes), state_facts(program))
    assert not isinstance(found, Declined), found
    frames = [_frames(next(iter(at.values()))) for at, _ in found]
    assert frames == sorted(set(map(_frames, range(100, 20001))))
    # each class is named by its first length, and the value is the one at that length
    for n, (_, value) in zip(frames, found, strict=True):
        assert value.shape == (n, 1) and bool(value.all())
    assert [next(iter(at.values())) for at, _ in found][:2] == [100, 110]


def test_declines_when_the_frame_counts_are_too_many_to_check():
    program, nodes = _samples_program(100, 100_000)  # 9989 frame counts
    found = known_at_every_size(program, _the_compare(nodes), state_facts(program))
    assert isinstance(found, Declined) and "distinct sizes, over 4096" in found.reason, found


def test_the_declared_range_is_checked_where_a_guard_narrowed_the_environment():
    program, nodes = _samples_program(100, 2000)
    x = program.graph_signature.user_inputs[0]
    size = nodes[x].meta["val"].shape[1].node
    size.shape_env.constrain_symbol_range(size.expr, 100, 1000)  # as a guard would
    found = known_at_every_size(program, _the_compare(nodes), state_facts(program))
    assert _frames(next(iter(found[-1][0].values()))) == _frames(2000)


def test_the_elements_of_a_broadcast_are_those_of_its_source():
    program, nodes = _samples_program(100, 2000)
    (expand,) = (n for n in nodes.values() if n.target is torch.ops.aten.expand.default)
    assert elements_source(expand) is _the_compare(nodes)
    assert elements_source(_the_compare(nodes)) is _the_compare(nodes)


class Strided(torch.nn.Module):
    """Positions of the frames a chain of (kernel, stride) convolutions makes of `x`'s
    samples, computed from the sample count alone."""

    def __init__(self, convs: tuple[tuple[int, int], ...]):
        super().__init__()
        self.convs = convs

    def forward(self, x):
        frames = x.shape[1]
        for kernel, stride in self.convs:
            frames = (frames - kernel) // stride + 1
        return x.sum() + (torch.arange(frames) * 2).sum()


def _chain(length: int, convs) -> int:
    for kernel, stride in convs:
        length = (length - kernel) // stride + 1
    return length


@settings(max_examples=6, deadline=None)
@given(
    convs=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 6)), min_size=1, max_size=3).map(
        tuple
    ),
    low=st.integers(200, 400),
    span=st.integers(4200, 9000),
)
def test_generated_frame_counts_are_each_checked_once(convs, low, span):
    high = low + span
    dynamic = ({1: torch.export.Dim.DYNAMIC(min=low, max=high)},)
    program = torch.export.export(
        Strided(convs), (torch.randn(1, low + 7),), dynamic_shapes=dynamic
    )
    mark_for_lowering({"forward": program})
    (doubled,) = (n for n in program.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    found = known_at_every_size(program, doubled, state_facts(program))
    # export may raise the lower bound (a guard of its own: no single frame, say)
    (declared,) = program.range_constraints.values()
    lengths = range(int(declared.lower), int(declared.upper) + 1)
    frames = sorted({_chain(length, convs) for length in lengths})
    if len(frames) > MAX_SIZES:
        assert isinstance(found, Declined) and f"{len(frames)} " in found.reason, found
        return
    assert [len(value) for _, value in found] == frames
    for at, value in found:
        assert torch.equal(value, torch.arange(_chain(next(iter(at.values())), convs)) * 2)


# fills that read an operand's shape (and dtype), never its values: the tensor's shape
FILLS = {
    "zeros_like": lambda x: torch.zeros_like(x),
    "ones_like": lambda x: torch.ones_like(x, dtype=torch.bool),
    "full_like": lambda x: torch.full_like(x, 7),
    "new_full": lambda x: x.new_full((2, x.shape[1]), 3),
    "new_ones": lambda x: x.new_ones(x.shape),
}


class Filled(torch.nn.Module):
    def __init__(self, fill, offset: int = 0):
        super().__init__()
        self.fill, self.offset = fill, offset

    def forward(self, ids):
        return self.fill(ids + self.offset if self.offset else ids) * 2


def _filled(fill, dynamic: bool, offset: int = 0):
    ids = torch.randint(0, 9, (1, 5))
    shapes = ({1: torch.export.Dim("length", min=2, max=9)},) if dynamic else None
    program = torch.export.export(Filled(fill, offset), (ids,), dynamic_shapes=shapes)
    (out,) = [n for n in program.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    return program, out


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(
    name=st.sampled_from(sorted(FILLS)),
    dynamic=st.booleans(),
    offset=st.sampled_from([0, 4]),
)
def test_a_fill_shaped_like_a_user_input_is_known_at_every_size(name, dynamic, offset):
    """A fill reads its operand's shape, whatever computed that operand from the user's
    values: its value is the fill of that shape, at each size the bounds allow."""
    program, out = _filled(FILLS[name], dynamic, offset)
    assert not reads_user_values(out, program)
    found = known_at_every_size(program, out, state_facts(program))
    lengths = range(2, 10) if dynamic else (5,)
    assert [at.get(next(iter(at), None), 5) for at, _ in found] == list(lengths)
    for (_, value), length in zip(found, lengths, strict=True):
        ids = torch.randint(0, 9, (1, length))
        assert torch.equal(value, Filled(FILLS[name], offset)(ids))


def test_a_fill_whose_operand_is_also_read_for_its_values_is_not_known():
    class FillAndValues(torch.nn.Module):
        def forward(self, ids):
            return torch.zeros_like(ids) + ids

    ids = torch.randint(0, 9, (1, 5))
    program = torch.export.export(FillAndValues(), (ids,))
    (add,) = [n for n in program.graph.nodes if n.target is torch.ops.aten.add.Tensor]
    assert reads_user_values(add, program)
    assert known_at_every_size(program, add, state_facts(program)) == Declined(
        "`add` reads the values of user input ids"
    )


def test_an_uninitialized_tensor_like_a_user_input_is_not_a_fill():
    """`empty_like` then `fill_` is left to the ops: `empty_like`'s values are not
    defined, so it is not counted as reading the shape alone."""
    program, out = _filled(lambda x: torch.empty_like(x).fill_(3), dynamic=False)
    assert reads_user_values(out, program)
