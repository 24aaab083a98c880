# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A dynamic program is planned for the bounds its export declared, or etfold's lowering
refuses naming the bound: a 1-D convolution over audio declared up to 32,000 samples and
traced at 8,000, whose kernel choice torch's fake convolution would guard at 20,480."""

from __future__ import annotations

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as StockPartitioner,
)

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.exir import DeclaredBoundNarrowed, declared_bounds_kept, to_edge_transform_and_lower
from etfold.harness.xnnpack_runner import eager_outputs, lower_xnnpack, max_abs_error

LOW, HIGH = 100, 32000
# torch's fake convolution prefers its native kernel up to this many input elements
KERNEL_CHOICE_AT = 20480


class Frames(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(1, 4, 10, stride=5)

    def forward(self, x):
        return torch.relu(self.conv(x[:, None]))


def _frames() -> Frames:
    torch.manual_seed(0)
    return Frames().eval()


def _export(traced: int = 8000) -> torch.export.ExportedProgram:
    samples = torch.export.Dim("samples", min=LOW, max=HIGH)
    inputs = (torch.randn(1, traced, generator=torch.Generator().manual_seed(traced)),)
    return torch.export.export(_frames(), inputs, dynamic_shapes=({1: samples},))


def _length(graph: torch.fx.Graph):
    """The length's symbolic size: dim 1 of the program's input `x`."""
    (x,) = (node for node in graph.nodes if node.name == "x")
    return x.meta["val"].shape[1].node


def _range_and_guards(program: torch.export.ExportedProgram):
    size = _length(program.graph)
    return size.shape_env.var_to_range[size.expr], len(size.shape_env.guards)


def _lower(program, **options):
    return lower_xnnpack(
        program, [XnnpackPartitioner()], lower=to_edge_transform_and_lower, **options
    )


def _errors_at_the_bounds(lowered) -> list[float]:
    module, errors = _frames(), []
    for length in (LOW, KERNEL_CHOICE_AT + 1, HIGH):
        inputs = (torch.randn(1, length, generator=torch.Generator().manual_seed(length)),)
        errors.append(max_abs_error(lowered.run(*inputs), eager_outputs(module, inputs)))
    return errors


def test_outside_the_scope_the_lowering_refuses_the_bound_to_executorch_would_narrow():
    program = _export()
    before = _range_and_guards(program)
    with pytest.raises(DeclaredBoundNarrowed) as refused:
        _lower(program)
    said = str(refused.value)
    assert "\n" not in said
    assert f"dim 1 of `x` is declared up to {HIGH}" in said, said
    assert f"plan it for {KERNEL_CHOICE_AT}" in said and f"<= {KERNEL_CHOICE_AT}`" in said, said
    assert "declared_bounds_kept()" in said, said
    assert _range_and_guards(program) == before  # the user's shape environment is untouched


def test_inside_the_scope_the_program_runs_at_every_bound():
    program = _export()
    before = _range_and_guards(program)
    lowered = _lower(program, keep_declared_bounds=True)
    assert max(_errors_at_the_bounds(lowered)) <= 1e-5
    # to_executorch guards its dim orders, which narrows no range
    assert _range_and_guards(program)[0] == before[0]


class NarrowingPass(torch.fx.passes.infra.pass_base.PassBase):
    """A transform that narrows the length's range, as a guard taken while lowering does."""

    def call(self, graph_module):
        size = _length(graph_module.graph)
        size.shape_env.constrain_symbol_range(size.expr, LOW, 9000)
        return torch.fx.passes.infra.pass_base.PassResult(graph_module, False)


def test_a_lowering_that_narrows_a_declared_bound_is_refused_and_the_range_put_back():
    program = _export()
    before = _range_and_guards(program)
    with declared_bounds_kept(), pytest.raises(DeclaredBoundNarrowed) as refused:
        to_edge_transform_and_lower(
            program, transform_passes=[NarrowingPass()], partitioner=[XnnpackPartitioner()]
        )
    said = str(refused.value)
    assert f"declared up to {HIGH}, but the lowering narrowed" in said and "9000" in said, said
    assert _range_and_guards(program)[0] == before[0]


def test_an_export_an_earlier_to_executorch_narrowed_is_refused_before_lowering():
    program = _export()
    lower_xnnpack(program, [StockPartitioner()])  # stock plans it for 20480, in its env
    assert _range_and_guards(program)[0].upper == KERNEL_CHOICE_AT
    with declared_bounds_kept(), pytest.raises(DeclaredBoundNarrowed) as refused:
        to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    said = str(refused.value)
    assert f"dim 1 of `x` is declared up to {HIGH}" in said, said
    assert "already bounds s" in said and f"by {KERNEL_CHOICE_AT}" in said, said


class Checking(torch.fx.passes.infra.pass_base.PassBase):
    """A transform that reads the length's range, as the checks at every size do."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def call(self, graph_module):
        size = _length(graph_module.graph)
        self.seen.append(size.shape_env.var_to_range[size.expr])
        return torch.fx.passes.infra.pass_base.PassResult(graph_module, False)


def test_a_lower_bound_a_guard_raised_is_the_declared_one_while_lowering():
    program = _export()
    size = _length(program.graph)
    size.shape_env.constrain_symbol_range(size.expr, 5000, HIGH)  # a guard at the traced size
    checking = Checking()
    with declared_bounds_kept():
        to_edge_transform_and_lower(
            program, transform_passes=[checking], partitioner=[XnnpackPartitioner()]
        )
    assert [(r.lower, r.upper) for r in checking.seen] == [(LOW, HIGH)]
    assert _range_and_guards(program)[0].lower == 5000  # put back


@pytest.mark.long  # the short profile holds the scope's plan at the bounds
def test_traced_above_the_kernel_choice_the_lowering_plans_the_bound_outside_the_scope():
    program = _export(traced=24000)
    lowered = _lower(program)
    assert max(_errors_at_the_bounds(lowered)) <= 1e-5
