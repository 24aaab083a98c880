# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Across the report's XNNPACK models, no op outside a delegate is there unexplained.

Each op left outside a delegate either computes from a user input (directly or
through other ops, delegates included), so no fold could remove it, or is named
in a decline recorded during the lowering (a budget, or a reason). Every model
`etfold report --backend xnnpack` lowers is checked (its fp32 twins in `make
test-long`), each lowered once through etfold's entry point and partitioner, as
the report does.
"""

from __future__ import annotations

import pytest
import torch
from torch.export.graph_signature import InputKind

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.decisions import collect_decisions
from etfold.demo_models import catalogue, load
from etfold.exir import to_edge_transform_and_lower
from etfold.exir.passes.graph_walk import input_kinds
from etfold.harness.modules import in_eval_mode

_DELEGATE_CALL = torch.ops.higher_order.executorch_call_delegate


def _same_build(build) -> tuple:
    """Two builders with the same code and captured values build the same model."""
    code = build.__code__
    captured = tuple(cell.cell_contents for cell in build.__closure__ or ())
    return code.co_code, code.co_consts, code.co_names, captured


def _cases() -> list:
    """Every XNNPACK report row, and each distinct fp32 twin the report lowers beside them."""
    entries = [e for e in catalogue() if e.backend == "xnnpack"]
    cases, twins = [], set()
    for entry, model in zip(entries, load(entries), strict=True):
        missing = entry.missing()
        marks = [pytest.mark.skip(reason=f"needs {', '.join(missing)}")] if missing else []
        cases.append(pytest.param(model, model.build, id=model.name, marks=marks))
        if model.fp32_twin is not None and _same_build(model.fp32_twin) not in twins:
            twins.add(_same_build(model.fp32_twin))
            twin_id = f"{model.name}-fp32_twin"
            twin_marks = [*marks, pytest.mark.long]  # fp32 graphs: the rows' own cover their ops
            cases.append(pytest.param(model, model.fp32_twin, id=twin_id, marks=twin_marks))
    return cases


def reads_user_input(node: torch.fx.Node, kinds: dict[str, InputKind]) -> bool:
    stack, seen = [node], {node}
    while stack:
        current = stack.pop()
        if current.op == "placeholder" and kinds.get(current.name) == InputKind.USER_INPUT:
            return True
        for producer in current.all_input_nodes:
            if producer not in seen:
                seen.add(producer)
                stack.append(producer)
    return False


def ops_outside(program) -> list[torch.fx.Node]:
    return [
        node
        for node in program.graph.nodes
        if node.op == "call_function"
        and node.target is not _DELEGATE_CALL
        and getattr(node.target, "__name__", "") != "getitem"
    ]


def _unexplained(model, build) -> list[str]:
    module, inputs = build()
    program = torch.export.export(in_eval_mode(module), inputs)
    partitioner = XnnpackPartitioner(**model.partitioner_kwargs)
    with collect_decisions() as decisions:
        edge = to_edge_transform_and_lower(program, partitioner=[partitioner])
    lowered = edge.exported_program()
    declined = {d.where for d in decisions if not d.applied}
    kinds = input_kinds(lowered)
    return [
        f"{node.name} ({node.target})"
        for node in ops_outside(lowered)
        if not reads_user_input(node, kinds) and node.name not in declined
    ]


@pytest.mark.parametrize("model, build", _cases())
def test_every_op_outside_a_delegate_reads_a_user_input_or_was_declined(model, build):
    assert _unexplained(model, build) == []
