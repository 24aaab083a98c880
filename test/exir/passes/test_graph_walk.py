# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""`drop_unread`: the pure ops nothing reads, and what they read in turn, go; an op
still read, a placeholder, or an impure op stays; export's metadata checks of a
dropped value go with it. `call_with_value`: a new node with the value it is given.
`STATE_KINDS`: the placeholders whose value the program holds."""

from __future__ import annotations

import torch

from etfold.exir.passes.graph_walk import (
    STATE_KINDS,
    ancestors,
    call_with_value,
    drop_unread,
    state_placeholders,
    value_ancestors,
)


def _graph():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    kept = graph.call_function(torch.ops.aten.neg.default, (x,))
    shared = graph.call_function(torch.ops.aten.abs.default, (x,))
    unread = graph.call_function(torch.ops.aten.add.Tensor, (shared, kept))
    checked = graph.call_function(torch.ops.aten.exp.default, (shared,))
    graph.call_function(
        torch.ops.aten._assert_tensor_metadata.default, (checked,), {"dtype": torch.float32}
    )
    graph.output((kept,))
    return graph, {"x": x, "kept": kept}, unread, checked


def _ops(graph) -> list[str]:
    return [str(node.target) for node in graph.nodes if node.op == "call_function"]


def test_what_nothing_reads_goes_with_what_it_alone_reads():
    graph, nodes, unread, checked = _graph()
    drop_unread([unread])
    # the add goes; abs is still read by exp; neg by the output
    assert _ops(graph) == [
        "aten.neg.default",
        "aten.abs.default",
        "aten.exp.default",
        "aten._assert_tensor_metadata.default",
    ]
    drop_unread([checked])
    # exp was read by its metadata check alone: both go, then abs, which only exp read
    assert _ops(graph) == ["aten.neg.default"]
    assert "x" in nodes and nodes["x"].op == "placeholder"


def test_an_op_still_read_or_a_placeholder_stays():
    graph, nodes, _, _ = _graph()
    drop_unread([nodes["kept"], nodes["x"]])
    assert len(_ops(graph)) == 5


def test_value_ancestors_stop_at_a_size_read():
    class LengthOfPooled(torch.nn.Module):
        def forward(self, x):
            h = torch.nn.functional.avg_pool1d(torch.relu(x), 2)
            return h.sum() + torch.arange(h.shape[-1]).sum()

    half = torch.export.Dim("half", min=2, max=8)
    program = torch.export.export(
        LengthOfPooled(), (torch.randn(1, 3, 8),), dynamic_shapes=({2: 2 * half},)
    )
    (arange,) = program.graph.find_nodes(op="call_function", target=torch.ops.aten.arange.default)
    (size,) = arange.all_input_nodes
    assert size.target is torch.ops.aten.sym_size.int and size.args[0].name == "avg_pool1d"
    assert {n.name for n in value_ancestors(arange)} == {"arange", size.name}
    assert {"x", "relu", "avg_pool1d"} <= {n.name for n in ancestors(arange)}


def test_call_with_value_gives_the_new_node_its_value_and_only_the_meta_asked_for():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta.update({"val": torch.ones(2, 3), "stack_trace": "model.py:1"})
    bare = call_with_value(graph, torch.ops.aten.neg.default, (x,), value := torch.zeros(2, 3))
    assert bare.args == (x,) and bare.meta == {"val": value}
    like = call_with_value(graph, torch.ops.aten.t.default, (bare,), torch.zeros(3, 2), x.meta)
    assert like.meta["stack_trace"] == "model.py:1" and like.meta["val"].shape == (3, 2)
    assert x.meta["val"].shape == (2, 3)  # the metadata it was given is copied, not written
    assert _ops(graph) == ["aten.neg.default", "aten.t.default"]


class _Held(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))
        self.register_buffer("scale", torch.ones(3))
        self.offset = torch.ones(3)  # lifted as a tensor constant

    def forward(self, x):
        return x * self.weight * self.scale + self.offset


def test_state_kinds_are_what_the_program_holds_and_never_a_user_input():
    program = torch.export.export(_Held(), (torch.ones(3),))
    kinds = {s.kind for s in program.graph_signature.input_specs}
    assert kinds - STATE_KINDS == {torch.export.graph_signature.InputKind.USER_INPUT}
    assert sorted(state_placeholders(program)) == ["offset", "scale", "weight"]
