# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The one node-rewrite driver: every decision recorded, each match rewritten in order."""

import operator

import torch

from etfold.decisions import Declined, collect_decisions
from etfold.exir.passes.node_rewrite_driver import rewrite_each_match, rewrite_judged_on_a_copy


class MulChain(torch.nn.Module):
    def forward(self, x):
        return ((x * 1.0) * 2.0) * 1.0


def _multiplies(graph_module):
    return [n for n in graph_module.graph.nodes if n.target is operator.mul]


def _match_times_one(node):
    if node.args[1] == 1.0:
        return node
    return Declined(f"{node.name} multiplies by {node.args[1]}")


def _drop(node):
    node.replace_all_uses_with(node.args[0])
    node.graph.erase_node(node)
    return f"{node.name} was a multiply by one"


def test_each_match_is_rewritten_and_each_decision_recorded_where_the_caller_says():
    graph_module = torch.fx.symbolic_trace(MulChain())
    with collect_decisions() as decisions:
        modified = rewrite_each_match(
            _multiplies(graph_module),
            _match_times_one,
            _drop,
            "test.fold",
            where=lambda n: n.name.upper(),
        )
    graph_module.recompile()
    assert modified
    assert [n.args[1] for n in _multiplies(graph_module)] == [2.0]
    assert [(d.applied, d.where) for d in decisions] == [
        (True, "MUL"),
        (False, "MUL_1"),
        (True, "MUL_2"),
    ]
    x = torch.randn(3)
    torch.testing.assert_close(graph_module(x), x * 2.0)


def test_a_later_match_sees_the_graph_earlier_rewrites_left():
    graph_module = torch.fx.symbolic_trace(MulChain())
    seen = []

    def match(node):
        seen.append(node.args[0].name)
        return node if node.args[1] == 1.0 else None

    rewrite_each_match(_multiplies(graph_module), match, _drop, "test.fold")
    assert seen == ["x", "x", "mul_1"]


def test_nothing_matched_leaves_the_graph_and_says_so():
    graph_module = torch.fx.symbolic_trace(MulChain())
    before = str(graph_module.graph)
    with collect_decisions() as decisions:
        modified = rewrite_each_match(_multiplies(graph_module), lambda n: None, _drop, "test.fold")
    assert not modified and not decisions and str(graph_module.graph) == before


def _judge_times_one(node):
    """On the program: the factor for a mul by a number (1.0 matches), else None."""
    if node.op != "call_function" or node.target is not torch.ops.aten.mul.Tensor:
        return None
    if not isinstance(node.args[1], float):
        return None
    return node.args[1] if node.args[1] == 1.0 else Declined(f"by {node.args[1]}")


def _drop_on_the_copy(match):
    node, judged_on = match
    assert node.graph is not judged_on.graph  # the copy's node, matched by name
    node.replace_all_uses_with(node.args[0])
    node.graph.erase_node(node)


def test_judged_once_on_the_program_and_rewritten_on_a_copy():
    program = torch.export.export(MulChain(), (torch.randn(3),))
    code = program.graph_module.code
    judged = []

    def judge(node):
        judged.append(node.graph)
        return _judge_times_one(node)

    originals = {n.name: n for n in program.graph.nodes}
    with collect_decisions() as decisions:
        rewritten = rewrite_judged_on_a_copy(
            program,
            judge,
            lambda node, factor: (node, originals[node.name]),
            _drop_on_the_copy,
            "test.fold",
        )
    assert rewritten is not program and program.graph_module.code == code
    assert set(judged) == {program.graph}  # never judged on the copy
    assert [(d.applied, d.where) for d in decisions] == [(False, "mul_1")]
    x = torch.randn(3)
    torch.testing.assert_close(rewritten.module()(x), x * 2.0)


def test_nothing_judged_returns_the_program_itself():
    program = torch.export.export(MulChain(), (torch.randn(3),))
    with collect_decisions() as decisions:
        assert rewrite_judged_on_a_copy(program, lambda n: None, None, None, "test.fold") is program
    assert not decisions


class Doubled(torch.nn.Module):
    def forward(self, x):
        return x * 2.0


def _dynamic_doubled():
    rows = torch.export.Dim("rows", min=2, max=16)
    return torch.export.export(Doubled(), (torch.randn(4, 3),), dynamic_shapes=({0: rows},))


def _transposing(value_of):
    """A rewrite that gives the multiply a transposed fake value, built by `value_of`."""

    def rewrite(node):
        node.meta["val"] = value_of(node.meta["val"])

    return rewrite


def _the_multiply(node):
    return node if node.target is torch.ops.aten.mul.Tensor else None


def test_a_rewrite_that_fixes_a_symbolic_size_is_an_error_naming_the_pass():
    import pytest

    from etfold.exir.passes.node_rewrite_driver import (
        SizeFixedByRewrite,
        fixed_sizes,
        rewrite_matches_on_a_copy,
    )

    program = _dynamic_doubled()
    assert fixed_sizes(program) == {}
    # a meta function run on a fake value fixes the rows at their traced 4
    by_copy = _transposing(lambda v: torch.ops.aten.permute_copy.default(v, [1, 0]))
    with pytest.raises(SizeFixedByRewrite, match=r"test\.fold fixed the symbolic sizes s\d+ = 4"):
        rewrite_matches_on_a_copy(program, _the_multiply, by_copy, "test.fold")


def test_a_rewrite_that_keeps_the_sizes_symbolic_passes():
    from etfold.exir.passes.node_rewrite_driver import fixed_sizes, rewrite_matches_on_a_copy

    program = _dynamic_doubled()
    by_view = _transposing(lambda v: v.permute(1, 0).contiguous())
    rewritten = rewrite_matches_on_a_copy(program, _the_multiply, by_view, "test.fold")
    assert rewritten is not program and fixed_sizes(rewritten) == {}


class NegOfNeg(torch.nn.Module):
    def forward(self, x):
        return torch.neg(torch.neg(x)) + 1


def test_on_a_copy_a_later_match_reads_the_node_an_earlier_rewrite_put_in():
    """Each neg is replaced by a new node: the second neg's match is taken after the
    first rewrite, so it reads the first one's replacement, never the erased neg."""
    from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy

    program = torch.export.export(NegOfNeg(), (torch.randn(3),))
    read = []

    def match(node):
        if node.target is not torch.ops.aten.neg.default:
            return None
        read.append(node.args[0].name)
        return node

    def rewrite(node):
        with node.graph.inserting_before(node):
            replacement = node.graph.call_function(torch.ops.aten.mul.Tensor, (node.args[0], -1.0))
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        node.graph.erase_node(node)

    rewritten = rewrite_matches_on_a_copy(program, match, rewrite, "test.fold")
    assert read == ["x", "neg", "x", "mul_tensor"]  # the scan of the program, then the copy's
    x = torch.randn(3)
    torch.testing.assert_close(rewritten.module()(x), x + 1)
    assert [n.target for n in program.graph.nodes].count(torch.ops.aten.neg.default) == 2
