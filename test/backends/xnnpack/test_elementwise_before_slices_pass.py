# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A unary op read through several slices of one tensor runs once over the tensor."""

from __future__ import annotations

import functools
import re
from collections import Counter

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.elementwise_before_slices_pass import (
    BINARY_ELEMENTWISE,
    FOLD,
    UNARY_ELEMENTWISE,
    delegated_elementwise_ops,
    elementwise_ops_before_slices,
)
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.dynamic_shapes import lower_dynamic
from etfold.harness.xnnpack_runner import lower_module_xnnpack

aten = torch.ops.aten
ALL_ELEMENTWISE = delegated_elementwise_ops(
    [*UNARY_ELEMENTWISE.values(), *BINARY_ELEMENTWISE.values()]
)


class Gates(torch.nn.Module):
    """An LSTM-like gate vector cut in four: three pieces through sigmoid, one through tanh."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.width = width

    def forward(self, x, c):
        gates, w = x * 2.0, self.width
        i, f = torch.sigmoid(gates[..., :w]), torch.sigmoid(gates[..., w : 2 * w])
        g, o = torch.tanh(gates[..., 2 * w : 3 * w]), torch.sigmoid(gates[..., 3 * w :])
        c = f * c + i * g
        return o * torch.tanh(c)


def _ops(program) -> Counter:
    return Counter(n.target for n in program.graph.nodes if n.op == "call_function")


def _rewritten(module, inputs, dynamic_shapes=None, ops=ALL_ELEMENTWISE):
    program = torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes)
    with collect_decisions() as decisions:
        rewritten = elementwise_ops_before_slices(program, ops, bf16=False)
    return program, rewritten, [d for d in decisions if d.fold == FOLD]


def test_three_sigmoids_of_slices_become_one_sigmoid_read_as_three_slices():
    inputs = (torch.randn(2, 32), torch.randn(2, 8))
    program, rewritten, decisions = _rewritten(Gates(), inputs)
    before, after = _ops(program), _ops(rewritten)
    assert (before[aten.sigmoid.default], after[aten.sigmoid.default]) == (3, 1)
    assert before[aten.tanh.default] == after[aten.tanh.default] == 2
    assert before[aten.slice.Tensor] == after[aten.slice.Tensor] == 4
    (sigmoid,) = rewritten.graph.find_nodes(op="call_function", target=aten.sigmoid.default)
    assert sigmoid.args[0].target is aten.mul.Tensor  # the whole gate vector
    assert {user.target for user in sigmoid.users} == {aten.slice.Tensor}
    assert [(d.applied, d.detail) for d in decisions] == [
        (True, "sigmoid.default over `mul` once, read as 3 slices along dim 1")
    ]
    torch.testing.assert_close(rewritten.module()(*inputs), program.module()(*inputs))
    assert _ops(program)[aten.sigmoid.default] == 3  # the program handed in is untouched


class LastStep(torch.nn.Module):
    """A recurrent net read at its last step, as upstream's LSTM op test reads it."""

    def __init__(self, cell: type[torch.nn.Module]):
        super().__init__()
        self.cell = cell(8, 8, batch_first=True)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        out, _ = self.cell(x)
        return self.head(out[:, -1, :])


@functools.cache
def _recurrent_lowerings(cell: type[torch.nn.Module]):
    torch.manual_seed(0)
    module = LastStep(cell).eval()
    x = torch.randn(1, 3, 8)
    lowered = {}
    for name, partitioner, lower in (
        ("stock", UpstreamXnnpackPartitioner, {}),
        ("etfold", XnnpackPartitioner, {"lower": to_edge_transform_and_lower}),
    ):
        with collect_decisions() as decisions:
            program, expected = lower_module_xnnpack(module, (x,), [partitioner()], **lower)
        lowered[name] = (program, [d for d in decisions if d.fold == FOLD])
    return lowered, expected, x


@pytest.mark.parametrize(
    ("cell", "hoisted"),
    [
        # each step: one sigmoid over its gate vector (the first step's gates included)
        (torch.nn.LSTM, ["sigmoid.default"] * 3),
        # each step after the first: one add of the gate pairs, one sigmoid of the sums
        # (the first step's hidden gates fold to a constant per gate: no slices to add)
        (torch.nn.GRU, ["add.Tensor"] * 2 + ["sigmoid.default"] * 2),
    ],
    ids=["lstm", "gru"],
)
def test_a_recurrent_net_runs_its_gates_in_one_delegate_bit_for_bit_as_stock(cell, hoisted):
    lowered, expected, x = _recurrent_lowerings(cell)
    program, decisions = lowered["etfold"]
    stock, _ = lowered["stock"]
    assert program.delegates() == 1 and not program.ops_outside()
    assert stock.delegates() > 1
    assert all(d.applied for d in decisions)
    assert sorted(d.detail.split(" ")[0] for d in decisions) == sorted(hoisted)
    actual, reference = program.run(x), stock.run(x)
    assert all(torch.equal(a, r) for a, r in zip(actual, reference, strict=True))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_slices_given_by_keyword_are_read_at_their_place():
    """A graph whose slices name their arguments (export writes them by position)."""

    class Halves(torch.nn.Module):
        def forward(self, x):
            return torch.tanh(x[:, :4]) * torch.tanh(x[:, 4:8])

    inputs = (torch.randn(3, 8),)
    program = torch.export.export(Halves(), inputs)
    expected = program.module()(*inputs)
    for piece in program.graph.find_nodes(op="call_function", target=aten.slice.Tensor):
        source, dim, start, end = piece.args
        piece.args, piece.kwargs = (source,), {"end": end, "dim": dim, "start": start}
    program.graph_module.recompile()
    with collect_decisions() as decisions:
        rewritten = elementwise_ops_before_slices(program, ALL_ELEMENTWISE, bf16=False)
    assert [d.detail for d in decisions if d.fold == FOLD] == [
        "tanh.default over `x` once, read as 2 slices along dim 1"
    ]
    assert torch.equal(rewritten.module()(*inputs), expected)


def test_slices_holding_too_little_of_the_tensor_stay_and_say_why():
    class Corners(torch.nn.Module):
        def forward(self, x):
            return torch.sigmoid(x[:, :2]) + torch.sigmoid(x[:, -2:])

    program, rewritten, decisions = _rewritten(Corners(), (torch.randn(3, 16),))
    assert rewritten is program
    assert [(d.applied, d.detail) for d in decisions] == [
        (
            False,
            "the slices hold 4 of 16 along dim 1: the op over the whole would compute "
            "more than 1.5x their elements",
        )
    ]


def test_slices_along_a_dynamic_dim_stay_and_say_why():
    class Halves(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x[:, :4]) * torch.relu(x[:, 4:8])

    frames = torch.export.Dim("frames", min=8, max=32)
    program, rewritten, decisions = _rewritten(
        Halves(), (torch.randn(2, 8),), dynamic_shapes=({1: frames},)
    )
    assert rewritten is program
    (decision,) = decisions
    assert not decision.applied
    assert re.fullmatch(
        r"dynamic shape: slices along dim 1 \(s\d+ in 8\.\.32\); the share of it the op "
        r"would compute changes with the input",
        decision.detail,
    )


def test_an_integer_tensor_stays_with_its_reason():
    class IntegerHalves(torch.nn.Module):
        def forward(self, x):
            return torch.neg(x[:, :4]) * torch.neg(x[:, 4:])

    program, rewritten, decisions = _rewritten(IntegerHalves(), (torch.arange(16).view(2, 8),))
    assert rewritten is program
    assert [(d.applied, d.detail.split(":")[0]) for d in decisions] == [
        (False, "torch.int64 elementwise op")
    ]


def test_a_dequantized_tensor_stays_with_its_reason():
    from torch.ao.quantization.fx import _decomposed  # noqa: F401  (registers the q/dq ops)

    class DequantizedHalves(torch.nn.Module):
        def forward(self, codes):
            x = torch.ops.quantized_decomposed.dequantize_per_tensor(
                codes, 0.1, 0, -128, 127, torch.int8
            )
            return torch.tanh(x[:, :4]) + torch.tanh(x[:, 4:])

    codes = torch.randint(-128, 128, (2, 8), dtype=torch.int8)
    program, rewritten, decisions = _rewritten(DequantizedHalves(), (codes,))
    assert rewritten is program
    assert [(d.applied, d.detail.split(":")[0]) for d in decisions] == [(False, "quantized input")]


def test_ops_with_other_arguments_or_not_delegated_are_not_grouped():
    class Slopes(torch.nn.Module):
        def forward(self, x):
            low = torch.nn.functional.leaky_relu(x[:, :4], 0.1)
            high = torch.nn.functional.leaky_relu(x[:, 4:], 0.2)
            return low + high + torch.sigmoid(x[:, :4]) + torch.sigmoid(x[:, 4:])

    inputs = (torch.randn(2, 8),)
    program, rewritten, decisions = _rewritten(Slopes(), inputs, ops={aten.leaky_relu.default: 1})
    assert rewritten is program and decisions == []


class GruGates(torch.nn.Module):
    """A GRU step's gates: two pairs of slices added, each sum through sigmoid."""

    def forward(self, a, b):
        r = torch.sigmoid(a[..., :8] + b[..., :8])
        z = torch.sigmoid(a[..., 8:16] + b[..., 8:16])
        n = torch.tanh(b[..., 16:] + r * a[..., 16:])
        return (1 - z) * n + z * 0.5


def test_added_pairs_of_slices_become_one_add_and_their_sigmoids_one_sigmoid():
    inputs = (torch.randn(2, 1, 24), torch.randn(2, 24))  # b broadcasts against a
    program, rewritten, decisions = _rewritten(GruGates(), inputs)
    before, after = _ops(program), _ops(rewritten)
    assert (before[aten.add.Tensor], after[aten.add.Tensor]) == (4, 3)
    assert (before[aten.sigmoid.default], after[aten.sigmoid.default]) == (2, 1)
    (sigmoid,) = rewritten.graph.find_nodes(op="call_function", target=aten.sigmoid.default)
    assert sigmoid.args[0].target is aten.add.Tensor
    assert [n.name for n in sigmoid.args[0].args] == ["a", "b"]
    assert [(d.applied, d.detail) for d in decisions] == [
        (True, "add.Tensor over `a`, `b` once, read as 2 slices along dim 2"),
        (True, "sigmoid.default over `add_tensor` once, read as 2 slices along dim 2"),
    ]
    torch.testing.assert_close(rewritten.module()(*inputs), program.module()(*inputs))


def test_pairs_of_slices_of_other_sizes_or_places_are_not_grouped():
    class Unaligned(torch.nn.Module):
        def forward(self, a, b, c):
            # b's slices lie at other places than a's; c is shorter along the sliced dim
            return (a[:, :4] + b[:, 4:8]) * (a[:, 4:8] + b[:, :4]) + (
                (a[:, :4] - c[:, :4]) * (a[:, 4:8] - c[:, 4:8])
            )

    inputs = (torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 10))
    program, rewritten, decisions = _rewritten(Unaligned(), inputs)
    assert rewritten is program and decisions == []


@functools.cache
def _dynamic_gates():
    """Gates on [B, 32], the batch dynamic: the sliced dim is static, so the rewrite holds."""
    batch = torch.export.Dim("batch", min=1, max=16)
    module = Gates().eval()
    example = (torch.randn(4, 32), torch.randn(4, 8))
    program, decisions = lower_dynamic(
        module,
        example,
        ({0: batch}, {0: batch}),
        [XnnpackPartitioner()],
        lower=to_edge_transform_and_lower,
    )
    return module, program, [d for d in decisions if d.fold == FOLD]


def test_a_dynamic_export_decides_as_the_static_one():
    _, program, decisions = _dynamic_gates()
    _, _, static_decisions = _rewritten(Gates(), (torch.randn(4, 32), torch.randn(4, 8)))
    assert [(d.applied, d.detail) for d in decisions] == [
        (d.applied, d.detail) for d in static_decisions
    ]
    assert program.delegates() == 1 and not program.ops_outside()


@pytest.mark.parametrize("batch", [1, 7, 16], ids=["min", "between", "max"])
def test_the_dynamic_program_matches_eager_at_each_size(batch):
    module, program, _ = _dynamic_gates()
    x, c = torch.randn(batch, 32), torch.randn(batch, 8)
    (actual,) = program.run(x, c)
    torch.testing.assert_close(actual, module(x, c), atol=1e-5, rtol=1e-5)


class Pieces(torch.nn.Module):
    def __init__(self, op, bounds):
        super().__init__()
        self.op, self.bounds = op, bounds

    def forward(self, x, y):
        operands = (
            (lambda s, e: (x[:, s:e],))
            if self.op in UNARY
            else (lambda s, e: (x[:, s:e], y[:, s:e]))
        )
        parts = [self.op(*operands(start, end)) for start, end in self.bounds]
        return torch.cat(parts, dim=1) * 1.0


UNARY = (torch.sigmoid, torch.tanh, torch.relu, torch.exp, torch.abs)


@settings(max_examples=2, deadline=None)
@given(
    op=st.sampled_from([*UNARY, torch.add, torch.mul, torch.maximum]),
    cuts=st.lists(st.integers(1, 11), min_size=3, max_size=5, unique=True),
)
def test_generated_pieces_equal_the_stock_lowering_bit_for_bit(op, cuts):
    """Pieces of [0, 12) along dim 1 (neighbours and overlaps); stock runs each op on its
    slices in XNNPACK, etfold once over the tensors: the same values, bit for bit."""
    cuts = sorted(cuts)
    bounds = [(0, cuts[1]), *zip(cuts[:-1], cuts[1:], strict=True), (cuts[0], 12)]
    generator = torch.Generator().manual_seed(len(cuts))
    inputs = (torch.randn(3, 12, generator=generator), torch.randn(3, 12, generator=generator))
    module = Pieces(op, bounds).eval()
    with collect_decisions() as decisions:
        program, _ = lower_module_xnnpack(module, inputs, [XnnpackPartitioner()])
    stock, _ = lower_module_xnnpack(module, inputs, [UpstreamXnnpackPartitioner()])
    assert [d.applied for d in decisions if d.fold == FOLD] == [True]
    assert torch.equal(program.run(*inputs)[0], stock.run(*inputs)[0])
