# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The edge verifier's dtype check run once per graph, not once per program built over it.

Every `ExportedProgram` a lowering builds is verified, and the EXIR edge
verifier's dtype check executes the whole graph on fake tensors. A lowering
builds several programs over a graph the check has just passed (the edge
manager over the program it was made from, the fake copy `to_backend` makes,
the program after a pass that changed nothing the check reads): about half
the checks, 5 % of the suite. Inside `edge_dtype_check_once_per_graph()` a
graph that passed is remembered by everything the check reads: each node's
op, arguments and value, each placeholder's and constant's dtype, shape and
strides. The same graph again passes without re-running. A failing graph is
never remembered, so it fails as upstream fails; a graph with symbolic values
or anything the description does not cover is always checked.
"""

from __future__ import annotations

import contextlib
import importlib
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch
from executorch.exir.lowered_backend_module import LoweredBackendModule
from torch.fx import GraphModule, Node

from etfold.exir.passes.node_shapes import node_value
from etfold.exir.program.reentrant_patch import PatchUnavailable, ReentrantPatch, Replacement

_DEFINED_IN = "executorch.exir.verification.verifier"
_CHECK = "_check_tensor_args_matching_op_allowed_dtype"
_REMEMBERED_GRAPHS = 256

_PLAIN = (
    bool,
    int,
    float,
    str,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


class _Undescribed(Exception):
    """A value the description does not cover: the check runs."""


def _describe_tensor(tensor: torch.Tensor) -> tuple:
    layout = (*tensor.shape, *tensor.stride(), tensor.storage_offset())
    if not all(type(size) is int for size in layout):
        raise _Undescribed  # symbolic
    kind = (type(tensor), tensor.dtype, tensor.device, tensor.layout, tensor.requires_grad)
    return ("tensor", *kind, tensor.dim(), layout)


def _describe(value) -> tuple:
    """What the fake execution of a graph can read of one value, as a comparable tuple."""
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, Node):
        return ("node", value.name)
    if isinstance(value, torch.Tensor):
        return _describe_tensor(value)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_describe(item) for item in value))
    if type(value) is slice:
        return ("slice", _describe(value.start), _describe(value.stop), _describe(value.step))
    raise _Undescribed


def _describe_attribute(graph_module: GraphModule, target: str) -> tuple:
    value = operator.attrgetter(target)(graph_module)
    if isinstance(value, LoweredBackendModule):
        # only ever an operand of the delegate call, where the check stops
        return ("lowered module",)
    return _describe(value)


def _describe_node(graph_module: GraphModule, node: Node) -> tuple:
    if node.op not in ("placeholder", "get_attr", "call_function", "output"):
        raise _Undescribed
    value = node_value(node)
    if node.op == "placeholder" and "val" not in node.meta and node.users:
        raise _Undescribed  # upstream refuses the graph: let it say so
    if node.op == "call_function" and "val" not in node.meta:
        raise _Undescribed
    attribute = _describe_attribute(graph_module, node.target) if node.op == "get_attr" else ()
    target = node.target if node.op == "call_function" else str(node.target)
    arguments = _describe((node.args, tuple(node.kwargs.items())))
    return (node.op, node.name, target, arguments, _describe(value), attribute)


def graph_description(graph_module: GraphModule) -> tuple | None:
    """Everything the dtype check reads of `graph_module`, or None where something escapes it."""
    try:
        description = tuple(_describe_node(graph_module, node) for node in graph_module.graph.nodes)
        hash(description)
    except (_Undescribed, AttributeError, TypeError):
        return None
    return description


def passing_graphs_remembered(
    check: Callable[[GraphModule], None],
) -> Callable[[GraphModule], None]:
    """`check`, skipped for a graph described as one it passed (up to the last 256 of them)."""
    passed: OrderedDict[tuple, None] = OrderedDict()
    lock = threading.Lock()

    def check_unless_passed(graph_module: GraphModule) -> None:
        description = graph_description(graph_module)
        with lock:
            if description is not None and description in passed:
                passed.move_to_end(description)
                return
        check(graph_module)
        if description is not None:
            with lock:
                passed[description] = None
                if len(passed) > _REMEMBERED_GRAPHS:
                    passed.popitem(last=False)

    return check_unless_passed


def _replacements() -> list[Replacement]:
    defining = importlib.import_module(_DEFINED_IN)
    if not callable(vars(defining).get(_CHECK)):
        raise PatchUnavailable(f"{_DEFINED_IN}.{_CHECK} is gone")
    return [Replacement(defining, _CHECK, passing_graphs_remembered)]


PATCH = ReentrantPatch("edge_dtype_check_once", _replacements)


def upstreams_check() -> Callable[[GraphModule], None]:
    """Upstream's dtype check, also while the scope is entered (what the scope is compared against)."""
    return PATCH.original(importlib.import_module(_DEFINED_IN), _CHECK)


def edge_dtype_check_once_per_graph() -> contextlib.AbstractContextManager[None]:
    """While entered, in this context, a graph that passed the check passes again without
    re-running it; what passed is forgotten when the last entry anywhere closes."""
    return PATCH.scope()
