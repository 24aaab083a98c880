# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""`drop_unread`: the pure ops nothing reads, and what they read in turn, go; an op
still read, a placeholder, or an impure op stays; export's metadata checks of a
dropped value go with it. `call_with_value`: a new node with the value it is given.
`STATE_KINDS`: the placeholders whose value the program holds. `fresh_constant_name`:
the one naming rule of new constants (stem, then the value's digest, then the reader),
which `add_lifted_constant` follows; `constant_holding` finds an equal constant.
`relayout_root`: the constant behind a chain of views. `remove_unread_placeholder`: a
constant nothing reads leaves the program whole."""

from __future__ import annotations

import pytest
import torch

from etfold.exir.passes.graph_walk import (
    NAME_DIGEST_LENGTH,
    STATE_KINDS,
    add_lifted_constant,
    ancestors,
    call_with_value,
    constant_holding,
    constant_names,
    drop_unread,
    fresh_constant_name,
    is_relayout,
    relayout_root,
    remove_unread_placeholder,
    state_placeholders,
    tensor_digest,
    value_ancestors,
)
from etfold.exir.program.working_copy import copy_for_rewrite


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


def _held_program():
    return torch.export.export(_Held(), (torch.ones(3),))


def test_a_new_constant_is_named_by_its_stem_when_nothing_holds_it():
    program, value = _held_program(), torch.arange(3.0)
    assert fresh_constant_name(program.graph_module, program, "w.times_2", value) == "w_times_2"
    assert constant_names("w", value, "conv") == [
        "w",
        f"w_{tensor_digest(value, NAME_DIGEST_LENGTH)}",
        f"w_{tensor_digest(value, NAME_DIGEST_LENGTH)}_for_conv",
    ]


def test_a_held_name_gives_the_digest_then_the_reader_and_never_a_counter():
    program, value = _held_program(), torch.arange(3.0)
    digested = f"scale_{tensor_digest(value, NAME_DIGEST_LENGTH)}"
    # a buffer holds the stem: the value's digest makes the name fresh
    assert fresh_constant_name(program.graph_module, program, "scale", value) == digested
    first = add_lifted_constant(program, "scale", value)
    assert first.name == first.target == digested and torch.equal(
        program.constants[digested], value
    )
    # the same value from the same expression for another reader: the reader's name
    second = add_lifted_constant(program, "scale", value, reader="mul")
    assert second.target == f"{digested}_for_mul"
    with pytest.raises(RuntimeError, match="no fresh constant name"):
        add_lifted_constant(program, "scale", value, reader="mul")
    with pytest.raises(RuntimeError, match="no fresh constant name"):
        fresh_constant_name(program.graph_module, program, "scale", value)  # no reader


def test_other_data_under_a_name_gets_another_digest():
    program = _held_program()
    ones, twos = torch.ones(3), torch.full((3,), 2.0)
    add_lifted_constant(program, "c", ones)
    assert fresh_constant_name(program.graph_module, program, "c", twos) == (
        f"c_{tensor_digest(twos, NAME_DIGEST_LENGTH)}"
    )


def test_constant_holding_finds_only_the_very_value():
    program = _held_program()
    made = add_lifted_constant(program, "row", torch.arange(3.0))
    assert constant_holding(program, "row", torch.arange(3.0)) is made
    assert constant_holding(program, "row", torch.arange(3.0) + 1) is None
    assert constant_holding(program, "row", torch.arange(3)) is None  # another dtype
    scale = state_placeholders(program)["scale"]
    assert constant_holding(program, "scale", torch.ones(3)) is scale
    assert constant_holding(program, "absent", torch.ones(3)) is None


class Relaid(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 6))

    def forward(self, x):
        relaid = torch.transpose(self.weight.to(x.dtype), 0, 1).reshape(2, 3, 4).unsqueeze(0)
        computed = (self.weight * 2).t()
        return relaid, computed, self.weight.to(torch.float16).t()


def _by_name(program):
    return {node.name: node for node in program.graph.nodes}


def test_relayout_root_walks_back_through_views_and_same_dtype_converts_only():
    program = torch.export.export(Relaid(), (torch.randn(2),))
    relaid, computed, converted = program.graph.output_node().args[0]
    root, chain = relayout_root(relaid)
    assert root.name == "p_weight"
    assert [node.target for node in chain] == [
        torch.ops.aten.to.dtype,
        torch.ops.aten.transpose.int,
        torch.ops.aten.reshape.default,
        torch.ops.aten.unsqueeze.default,
    ]
    assert relayout_root(computed)[0].target is torch.ops.aten.mul.Tensor
    assert relayout_root(converted)[0].target is torch.ops.aten.to.dtype  # float16: computes
    assert relayout_root(root) == (root, ())
    assert not is_relayout(root)


def test_remove_unread_placeholder_erases_the_spec_value_and_node_and_refuses_a_read_one():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.randn(3))
            self.register_buffer("b", torch.randn(3))

        def forward(self, x):
            return x + self.a + self.b

    program = copy_for_rewrite(torch.export.export(Two(), (torch.randn(3),)))
    nodes = _by_name(program)
    with pytest.raises(ValueError, match="still read"):
        remove_unread_placeholder(program, nodes["p_a"])
    add = next(iter(nodes["p_a"].users))
    add.replace_all_uses_with(add.args[0])
    program.graph.erase_node(add)
    remove_unread_placeholder(program, nodes["p_a"])
    assert "p_a" not in _by_name(program) and "a" not in program.state_dict
    assert [s.arg.name for s in program.graph_signature.input_specs] == ["b_b", "x"]
