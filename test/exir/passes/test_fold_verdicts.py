# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The one home of each placeholder/op fact a fold asks: what kind of input a placeholder
is (`graph_walk.state_placeholders`), whether its value is known
(`graph_walk.known_placeholder`), and whether a fold may read it, run an op, or merge
`custom` meta (`constant_prop.verdicts`)."""

from __future__ import annotations

import torch
from torch.export.graph_signature import InputKind

from etfold.decisions import Declined
from etfold.exir.passes.constant_prop.verdicts import (
    EVERY_METHOD,
    FILLS_AND_QUANT_OPS,
    UNSET,
    SourcePolicy,
    agreed_custom,
    filled_with,
    op_verdict,
    source_custom,
    source_verdict,
)
from etfold.exir.passes.graph_walk import ConstantSource, known_placeholder, state_placeholders
from etfold.exir.program.buffer_marks import BUFFER_FOLD_BLOCKERS
from etfold.exir.program.method_marks import SHARED_ACROSS_METHODS


class Inputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.register_buffer("gain", torch.ones(4))
        self.register_buffer("state", torch.zeros(4))
        self.mask = torch.ones(4)  # a lifted tensor constant

    def forward(self, x):
        self.state.add_(x.sum())
        return x @ self.w.t() * self.gain * self.mask + self.state


def _program(functional=False):
    ep = torch.export.export(Inputs(), (torch.randn(2, 4),))
    return ep.run_decompositions({}) if functional else ep


def _placeholder(ep, fqn):
    return state_placeholders(ep)[fqn]


def test_state_placeholders_are_the_parameters_buffers_and_constants():
    ep = _program()
    state = state_placeholders(ep)
    assert sorted(state) == ["gain", "mask", "state", "w"]
    user = [n for n in ep.graph.find_nodes(op="placeholder") if n not in state.values()]
    assert [n.name for n in user] == ["x"]
    buffers = state_placeholders(ep, frozenset({InputKind.BUFFER}))
    assert sorted(buffers) == ["gain", "state"]


def test_known_placeholder_answers_alike_in_place_and_functionalized():
    for functional, how in ((False, "aten.add_.Tensor"), (True, "a functionalized mutation")):
        ep = _program(functional)
        written = known_placeholder(ep, _placeholder(ep, "state"))
        assert isinstance(written, Declined)
        assert written.reason == f"`state` is written in this method ({how})"
        for fqn in ("w", "gain", "mask"):
            assert isinstance(known_placeholder(ep, _placeholder(ep, fqn)), ConstantSource)
        x = next(n for n in ep.graph.find_nodes(op="placeholder") if n.name == "x")
        assert known_placeholder(ep, x) is None


def test_known_placeholder_declines_a_tensor_subclass():
    class Marked(torch.Tensor):
        pass

    ep = _program()
    ep.state_dict["w"] = ep.state_dict["w"].detach().as_subclass(Marked)
    found = known_placeholder(ep, _placeholder(ep, "w"))
    assert isinstance(found, Declined) and "not a plain tensor (Marked)" in found.reason


def test_source_verdict_policy_buffers_and_other_methods():
    ep = _program()
    gain, w = _placeholder(ep, "gain"), _placeholder(ep, "w")
    assert isinstance(source_verdict(ep, gain), ConstantSource)
    off = source_verdict(ep, gain, SourcePolicy(fold_buffers=False))
    assert off.reason == "buffer gain (fold_buffers=False)"
    unjudged = source_verdict(ep, gain, EVERY_METHOD)
    assert isinstance(unjudged, Declined) and "was not judged across methods" in unjudged.reason
    gain.meta[BUFFER_FOLD_BLOCKERS] = ()
    assert isinstance(source_verdict(ep, gain, EVERY_METHOD), ConstantSource)
    gain.meta[BUFFER_FOLD_BLOCKERS] = ("method `update` may write it (aten.mul_.Tensor)",)
    blocked = source_verdict(ep, gain, EVERY_METHOD)
    assert blocked.reason == "buffer `gain`: method `update` may write it (aten.mul_.Tensor)"
    w.meta[SHARED_ACROSS_METHODS] = True
    assert isinstance(source_verdict(ep, w), ConstantSource)  # one method: the mark is not read
    assert source_verdict(ep, w, EVERY_METHOD).reason == "`w` is read by several methods"


def test_op_verdict_judges_edge_ops_by_their_aten_op():
    from executorch.exir.dialects._ops import ops as exir_ops

    graph = torch.fx.Graph()
    a = graph.placeholder("a")
    edge_mul = graph.call_function(exir_ops.edge.aten.mul.Tensor, (a, a))
    aten_mul = graph.call_function(torch.ops.aten.mul.Tensor, (a, a))
    python = graph.call_function(repr, (a,))
    rand = graph.call_function(torch.ops.aten.rand_like.default, (a,))
    fill = graph.call_function(torch.ops.aten.ones_like.default, (a,))
    assert op_verdict(edge_mul, None) is None and op_verdict(aten_mul, None) is None
    assert "is not an ATen op" in op_verdict(python, None).reason
    assert op_verdict(rand, None).reason.startswith("nondeterministic op")
    assert op_verdict(fill, None) is None
    assert op_verdict(fill, FILLS_AND_QUANT_OPS).reason == "factory op that only fills a tensor"


def test_agreed_custom_an_untagged_source_takes_the_program_side():
    graph = torch.fx.Graph()
    tagged, other, plain = (graph.placeholder(n) for n in ("tagged", "other", "plain"))
    tagged.meta["custom"] = {"tag": "foundation"}
    other.meta["custom"] = {"tag": "foundation"}
    assert agreed_custom([tagged, other], source_custom) == {"tag": "foundation"}
    assert agreed_custom([plain], source_custom) == {}
    assert agreed_custom([], source_custom) is UNSET
    split = agreed_custom([tagged, plain], source_custom)
    assert isinstance(split, Declined)
    assert "`tagged` and `plain` disagree on their `custom` meta" in split.reason
    # a value computed from no source takes no side
    assert agreed_custom([tagged, plain], {tagged: {"tag": "x"}, plain: UNSET}.get) == {"tag": "x"}


class Fills(torch.nn.Module):
    def forward(self, x):
        return (
            torch.full_like(x, 0.5),
            torch.zeros_like(x),
            torch.ones_like(x),
            x.new_full((2,), -3),
            x.new_ones((2,)),
            torch.full((2,), 7.0),
            torch.where(x > 0, x, 0.25),
            x + 1,
        )


def test_filled_with_names_the_number_of_each_fill_and_no_other_node():
    program = torch.export.export(Fills(), (torch.randn(3),)).run_decompositions()
    fills = {
        node.name: filled_with(node)
        for node in program.graph.nodes
        if node.op == "call_function" and filled_with(node) is not None
    }
    assert sorted(fills.values()) == sorted([0.5, 0, 1, -3, 1, 7.0, 0.25])
    others = [n for n in program.graph.nodes if n.op != "call_function" or n.name not in fills]
    assert all(filled_with(node) is None for node in others)
