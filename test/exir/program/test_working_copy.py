# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The copy etfold rewrites: same names, same values, the original untouched."""

from __future__ import annotations

import torch

from etfold.exir.program.working_copy import copy_for_rewrite


class NamedLikeABuiltin(torch.nn.Module):
    """A forward argument named `input` (a Python builtin): nn.Module code is full of them."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3))

    def forward(self, input):
        return input * self.weight


def test_the_copy_keeps_every_node_name_and_verifies():
    program = torch.export.export(NamedLikeABuiltin(), (torch.randn(3),))
    copied = copy_for_rewrite(program)
    assert [n.name for n in copied.graph.nodes] == [n.name for n in program.graph.nodes]
    assert copied.graph is not program.graph
    x = torch.randn(3)
    assert torch.equal(copied.module()(x), program.module()(x))


def test_rewriting_the_copy_leaves_the_original_alone():
    program = torch.export.export(NamedLikeABuiltin(), (torch.randn(3),))
    code = program.graph_module.code
    copied = copy_for_rewrite(program)
    (mul,) = [n for n in copied.graph.nodes if n.op == "call_function"]
    mul.target = torch.ops.aten.add.Tensor
    copied.graph_module.recompile()
    assert program.graph_module.code == code
    assert copied.state_dict["weight"] is program.state_dict["weight"]  # tensors are shared


def test_a_program_that_lost_some_meta_val_is_copied_as_it_is():
    """Stock lowering accepts it; the copy must not re-verify and refuse it."""
    program = torch.export.export(NamedLikeABuiltin(), (torch.randn(3),))
    (mul,) = [n for n in program.graph.nodes if n.op == "call_function"]
    del mul.meta["val"]
    copied = copy_for_rewrite(program)
    (copied_mul,) = [n for n in copied.graph.nodes if n.op == "call_function"]
    assert "val" not in copied_mul.meta and copied.graph is not program.graph
