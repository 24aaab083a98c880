# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A program etfold may rewrite in place, without touching the one it was handed.

Upstream hands the user's own ATen program to `transform_for_pre_decomposition`.
A pass that rewrites the graph in place works on this copy instead: the graph,
its metadata and the signature are copied; the tensors (parameters, buffers,
constants) are shared, since no etfold pass writes into a tensor.
"""

from __future__ import annotations

import copy

import torch
from torch.export import ExportedProgram


def _keep_names(original: torch.fx.Graph, copied: torch.fx.Graph) -> None:
    """Copying a graph re-uniquifies node names (an input named `input`, a Python
    builtin, comes back as `input_1`); the signature names the originals."""
    renamed = False
    for before, after in zip(original.nodes, copied.nodes, strict=True):
        if after.name != before.name:
            after.name = before.name
            renamed = True
    if renamed:
        copied.owning_module.recompile()


def copy_for_rewrite(program: ExportedProgram) -> ExportedProgram:
    """A copy whose graph, node metadata, signature and module call graph are its own
    and whose tensors are shared.

    Built without ExportedProgram's constructor, which re-verifies (a program that
    lowers with stock ExecuTorch, missing `meta["val"]` say, must lower through
    etfold too) and rewrites the graph (getitem elimination).
    """
    graph_module = copy.deepcopy(program.graph_module)
    _keep_names(program.graph, graph_module.graph)
    copied = copy.copy(program)
    copied._graph_module = graph_module
    copied._graph_signature = copy.deepcopy(program.graph_signature)
    copied._state_dict = dict(program.state_dict)
    copied._constants = dict(program.constants)
    copied._range_constraints = copy.copy(program.range_constraints)
    copied._module_call_graph = copy.deepcopy(program.module_call_graph)
    return copied
