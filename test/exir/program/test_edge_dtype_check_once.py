# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The edge verifier's dtype check, remembered for graphs it passed, gives upstream's verdicts.

A graph passed once is not checked again until something the check reads
changes (a node's value, an input's dtype, a constant's shape); a failing graph
fails every time with upstream's error; a graph with symbolic shapes is always
checked. Generated sequences of graphs, repeats among them, get exactly the
verdicts upstream's check gives.
"""

from __future__ import annotations

import copy
import functools

import torch
from executorch.exir import to_edge
from executorch.exir.verification import verifier
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.exir.program.edge_dtype_check_once import (
    graph_description,
    passing_graphs_remembered,
    upstreams_check,
)


class _Elementwise(torch.nn.Module):
    def __init__(self, ops: tuple[str, ...]):
        super().__init__()
        self.ops = ops
        self.register_buffer("offset", torch.ones(3))

    def forward(self, x, y):
        for op in self.ops:
            x = {"add": x + y, "mul": x * y, "sub": x - self.offset, "relu": x.relu()}[op]
        return x


@functools.cache
def _edge_graph_built_once(
    ops: tuple[str, ...], dtype: torch.dtype, dynamic: bool
) -> torch.fx.GraphModule:
    inputs = (torch.ones(2, 3, dtype=dtype), torch.ones(2, 3, dtype=dtype))
    batch = torch.export.Dim("batch")
    shapes = ({0: batch}, {0: batch}) if dynamic else None
    exported = torch.export.export(_Elementwise(ops), inputs, dynamic_shapes=shapes)
    return to_edge(exported).exported_program().graph_module


def _edge_graph(ops=("add", "mul"), dtype=torch.float32, dynamic=False) -> torch.fx.GraphModule:
    """A new edge graph module (a copy: tests retype its nodes)."""
    return copy.deepcopy(_edge_graph_built_once(ops, dtype, dynamic))


class _Counted:
    def __init__(self):
        self.calls = 0

    def __call__(self, graph_module):
        self.calls += 1
        upstreams_check()(graph_module)


def _verdict(check, graph_module) -> tuple | None:
    try:
        check(graph_module)
    except Exception as error:  # the verdict is the error upstream raises, message included
        return type(error), str(error)
    return None


def _computing_node(graph_module, index: int = 0) -> torch.fx.Node:
    return [n for n in graph_module.graph.nodes if n.op == "call_function"][index]


def test_the_scope_wraps_upstreams_check_while_open_and_only_then():
    from etfold.exir.program.edge_dtype_check_once import edge_dtype_check_once_per_graph

    assert verifier._check_tensor_args_matching_op_allowed_dtype is upstreams_check()
    with edge_dtype_check_once_per_graph():
        assert verifier._check_tensor_args_matching_op_allowed_dtype is not upstreams_check()
    assert verifier._check_tensor_args_matching_op_allowed_dtype is upstreams_check()


def test_a_graph_that_passed_is_checked_again_only_when_something_the_check_reads_changes():
    upstream = _Counted()
    check = passing_graphs_remembered(upstream)
    graph_module, twin = _edge_graph(), _edge_graph()
    check(graph_module)
    check(graph_module)
    check(twin)  # another graph module (a deep copy), described alike
    assert upstream.calls == 1
    node = _computing_node(graph_module)
    node.meta["val"] = node.meta["val"].to(torch.float16)
    assert _verdict(check, graph_module) == _verdict(upstreams_check(), graph_module) is not None
    assert upstream.calls == 2


def test_a_failing_graph_fails_every_time_with_upstreams_error():
    upstream = _Counted()
    check = passing_graphs_remembered(upstream)
    graph_module = _edge_graph()
    node = _computing_node(graph_module)
    node.meta["val"] = node.meta["val"].to(torch.int64)
    expected = _verdict(upstreams_check(), graph_module)
    assert expected is not None and "mismatched dtypes" in expected[1]
    assert [_verdict(check, graph_module) for _ in range(3)] == [expected] * 3
    assert upstream.calls == 3


def test_a_graph_with_symbolic_shapes_is_checked_every_time():
    upstream = _Counted()
    check = passing_graphs_remembered(upstream)
    graph_module = _edge_graph(dynamic=True)
    assert graph_description(graph_module) is None
    check(graph_module)
    check(graph_module)
    assert upstream.calls == 2


def test_descriptions_differ_by_input_dtype_and_constant_shape_and_op():
    base = graph_description(_edge_graph())
    assert base is not None
    assert graph_description(_edge_graph(dtype=torch.bfloat16)) != base
    assert graph_description(_edge_graph(ops=("add", "add"))) != base
    reshaped = _edge_graph()
    buffer = next(n for n in reshaped.graph.nodes if n.op == "placeholder")
    buffer.meta["val"] = buffer.meta["val"].new_empty(4)
    assert graph_description(reshaped) != base


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool]


@st.composite
def _graphs(draw):
    ops = tuple(
        draw(st.lists(st.sampled_from(["add", "mul", "sub", "relu"]), min_size=1, max_size=3))
    )
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    retyped = draw(st.none() | st.tuples(st.integers(0, 8), st.sampled_from(_DTYPES)))
    return ops, dtype, retyped


def _built(ops, dtype, retyped) -> torch.fx.GraphModule:
    graph_module = _edge_graph(ops, dtype)
    if retyped is not None:
        computing = [n for n in graph_module.graph.nodes if n.op == "call_function"]
        node = computing[retyped[0] % len(computing)]
        node.meta["val"] = node.meta["val"].to(retyped[1])
    return graph_module


def test_generated_graph_sequences_get_upstreams_verdicts():
    upstream = _Counted()
    check = passing_graphs_remembered(upstream)
    checked = []

    @settings(max_examples=10, deadline=None)  # each draws up to 3 graphs, checked twice
    @given(st.lists(_graphs(), min_size=1, max_size=3))
    def sequence_of(drawn):
        for case in [*drawn, *drawn]:  # each graph again, after the others
            graph_module = _built(*case)
            assert _verdict(check, graph_module) == _verdict(upstreams_check(), graph_module)
            checked.append(case)

    sequence_of()
    assert upstream.calls < len(checked)  # repeats were remembered
