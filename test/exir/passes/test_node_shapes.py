# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""static_shape and rank_of: read from meta["val"]; a symbolic size is no static shape."""

from __future__ import annotations

import torch

from etfold.exir.passes.node_shapes import rank_of, static_shape


class Double(torch.nn.Module):
    def forward(self, x):
        return x * 2


def _mul(program):
    (node,) = [n for n in program.graph.nodes if n.op == "call_function"]
    return node


def test_static_program_has_shape_and_rank():
    node = _mul(torch.export.export(Double(), (torch.randn(2, 3),)))
    assert static_shape(node) == (2, 3) and rank_of(node) == 2


def test_dynamic_size_has_rank_but_no_static_shape():
    batch = torch.export.Dim("batch", min=2)
    program = torch.export.export(Double(), (torch.randn(2, 3),), dynamic_shapes=({0: batch},))
    node = _mul(program)
    assert static_shape(node) is None and rank_of(node) == 2


def test_no_tensor_value_has_neither():
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    assert static_shape(node) is None and rank_of(node) is None
    node.meta["val"] = 3
    assert static_shape(node) is None and rank_of(node) is None
    assert static_shape(7) is None and rank_of(None) is None
