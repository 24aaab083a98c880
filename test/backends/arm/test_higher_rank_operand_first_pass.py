# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""mul/add take their higher-rank operand first on the TOSA FP path.

Models run on the TOSA reference model and are compared with eager.
"""

import contextlib
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.arm import arm_folds_registered
from etfold.backends.arm._passes.higher_rank_operand_first_pass import (
    FOLD,
    HigherRankOperandFirstPass,
)
from etfold.decisions import collect_decisions
from etfold.harness.tosa_runner import FP, INT, lower_module_tosa


class RuntimeScaleFirst(torch.nn.Module):
    """`s * conv(x)` (or `s + conv(x)`), s a rank-0 value computed from x."""

    def __init__(self, op: str = "mul", in_channels: int = 1, out_channels: int = 2):
        super().__init__()
        self.op = op
        self.conv = torch.nn.Conv2d(in_channels, out_channels, 3)

    def forward(self, x):
        scale = torch.sigmoid(x.mean()) + 0.5
        y = self.conv(x)
        return scale * y if self.op == "mul" else scale + y


def _error(module, x, registered: bool) -> float:
    with arm_folds_registered() if registered else contextlib.nullcontext():
        program, reference = lower_module_tosa(copy.deepcopy(module), (x,), FP)
    (actual,) = program.run(x).outputs
    return float((actual - reference[0]).abs().max())


@pytest.mark.parametrize("op", ["mul", "add"])
def test_rank0_operand_first_is_right_on_the_reference_model(op):
    torch.manual_seed(0)
    module, x = RuntimeScaleFirst(op).eval(), torch.randn(1, 1, 7, 7)
    assert _error(module, x, registered=True) <= 1e-5


def test_stock_fp_lowering_of_a_rank0_first_mul_is_wrong():
    """The upstream wrong program this pass exists for; when it passes, upstream is fixed."""
    torch.manual_seed(0)
    module, x = RuntimeScaleFirst("mul").eval(), torch.randn(1, 1, 7, 7)
    assert _error(module, x, registered=False) > 0.1


def _edge_graph(first_rank: int, second_rank: int, dtype=torch.float32):
    from executorch.exir import to_edge

    class Binary(torch.nn.Module):
        def forward(self, a, b):
            return a * b

    shapes = {0: (), 1: (3,), 2: (2, 3), 4: (1, 2, 2, 3)}
    inputs = (
        torch.ones(shapes[first_rank], dtype=dtype),
        torch.ones(shapes[second_rank], dtype=dtype),
    )
    edge = to_edge(torch.export.export(Binary(), inputs))
    return edge.exported_program().graph_module


def _mul_ranks(graph_module):
    (mul,) = [n for n in graph_module.graph.nodes if n.op == "call_function"]
    return tuple(a.meta["val"].dim() for a in mul.args)


@settings(max_examples=6, deadline=None)
@given(first=st.sampled_from([0, 1, 2, 4]), second=st.sampled_from([0, 1, 2, 4]))
def test_only_a_lower_rank_first_operand_moves(first, second):
    graph_module = _edge_graph(first, second)
    with collect_decisions() as decisions:
        result = HigherRankOperandFirstPass()(graph_module)
    swapped = first < second
    assert result.modified == swapped
    assert _mul_ranks(result.graph_module) == ((second, first) if swapped else (first, second))
    assert [d.applied for d in decisions if d.fold == FOLD] == ([True] if swapped else [])


def test_integer_operands_keep_upstream_order():
    graph_module = _edge_graph(0, 4, dtype=torch.int32)
    assert not HigherRankOperandFirstPass()(graph_module).modified
    assert _mul_ranks(graph_module) == (0, 4)


class VectorFirstAdd(torch.nn.Module):
    """`v + conv(x)`, v a rank-1 parameter: a lower-rank first operand in both profiles."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3)
        self.v = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 4))

    def forward(self, x):
        return self.v + self.conv(x)


def test_int_profile_lowering_is_byte_identical_and_fp_is_right():
    """The quantized graph's adds are integer: INT lowers as stock does. FP swaps and stays right."""
    torch.manual_seed(1)
    module, x = VectorFirstAdd().eval(), torch.randn(1, 2, 6, 6)
    stock, _ = lower_module_tosa(copy.deepcopy(module), (x,), INT)
    with collect_decisions() as decisions, arm_folds_registered():
        ours, _ = lower_module_tosa(copy.deepcopy(module), (x,), INT)
    assert ours.tosa_graphs == stock.tosa_graphs
    assert not [d for d in decisions if d.fold == FOLD]
    assert _error(module, x, registered=True) <= 1e-5
