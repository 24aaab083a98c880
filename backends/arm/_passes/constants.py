# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Constants in the two forms a pass sees: read, create and delete them.

A pass sees constants in one of two forms: a placeholder of an ExportedProgram
(backend pipeline: parameter, buffer or lifted constant) or a `get_attr` of a
bare GraphModule (annotation pipeline, where the module's tensors are the
user's own). These helpers read, create and delete constants in either form,
and never write into an existing tensor. A new constant is named by
`graph_walk.fresh_constant_name`, the rule every etfold pass names constants by.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule, Node

from etfold.exir.passes.graph_walk import (
    ConstantSource,
    fresh_constant_name,
    known_placeholder,
    state_writes,
)
from etfold.exir.passes.node_shapes import node_value


def _get_attr_owner(
    graph_module: torch.nn.Module, target: str
) -> tuple[torch.nn.Module, str] | None:
    *path, leaf = target.split(".")
    owner = graph_module
    for atom in path:
        owner = getattr(owner, atom, None)
        if not isinstance(owner, torch.nn.Module):
            return None
    return owner, leaf


def get_attr_tensor(node: Node) -> torch.Tensor | None:
    """The tensor a `get_attr` node reads, or None when it reads something else."""
    if node.op != "get_attr" or node.graph.owning_module is None:
        return None
    located = _get_attr_owner(node.graph.owning_module, str(node.target))
    if located is None:
        return None
    value = getattr(located[0], located[1], None)
    return value if isinstance(value, torch.Tensor) else None


def _written_get_attr_targets(graph_module: GraphModule) -> set[str]:
    return {
        str(w.destination.target)
        for w in state_writes(graph_module)
        if w.destination.op == "get_attr"
    }


def constant_tensor(
    node: Node, exported_program: ExportedProgram | None = None
) -> torch.Tensor | None:
    """The tensor behind a constant node, or None if the node is not a constant.

    Constants: parameters, buffers nobody writes, lifted tensor constants of an
    ExportedProgram; `get_attr` tensors of a GraphModule that the graph never writes.
    """
    if node.op == "get_attr":
        graph_module = node.graph.owning_module
        if graph_module is None or str(node.target) in _written_get_attr_targets(graph_module):
            return None
        return get_attr_tensor(node)
    if (
        node.op != "placeholder"
        or exported_program is None
        or exported_program.graph is not node.graph
    ):
        return None
    found = known_placeholder(exported_program, node)
    return found.tensor if isinstance(found, ConstantSource) else None


def constant_kind(node: Node, exported_program: ExportedProgram) -> tuple[InputKind, bool | None]:
    """(kind, persistent) of a constant placeholder, for creating one like it."""
    signature = exported_program.graph_signature
    if node.name in signature.inputs_to_parameters:
        return InputKind.PARAMETER, None
    if node.name in signature.inputs_to_buffers:
        target = signature.inputs_to_buffers[node.name]
        return InputKind.BUFFER, target not in signature.non_persistent_buffers
    return InputKind.CONSTANT_TENSOR, None


def create_constant(
    graph_module: GraphModule,
    exported_program: ExportedProgram | None,
    *,
    like: Node,
    stem: str,
    data: torch.Tensor,
    reader: str | None = None,
) -> Node:
    """A new constant node holding `data`, of the same kind as `like`, named
    `fresh_constant_name(stem, data, reader)`.

    ExportedProgram: a placeholder (and signature entry) before the first
    placeholder. GraphModule: a new top-level attribute and a `get_attr` before
    the first node.
    """
    graph = graph_module.graph
    data = data.detach()
    name = fresh_constant_name(graph_module, exported_program, stem, data, reader)
    if exported_program is not None and like.op == "placeholder":
        from executorch.backends.transforms.utils import create_constant_placeholder

        kind, persistent = constant_kind(like, exported_program)
        first_placeholder = next(n for n in graph.nodes if n.op == "placeholder")
        with graph.inserting_before(first_placeholder):
            node = create_constant_placeholder(
                exported_program, graph, name, kind, data, persistent
            )
        node.meta["requested_name"] = name
        return node
    if isinstance(get_attr_tensor(like), torch.nn.Parameter):
        graph_module.register_parameter(name, torch.nn.Parameter(data, requires_grad=False))
    else:
        graph_module.register_buffer(name, data)
    with graph.inserting_before(next(iter(graph.nodes))):
        node = graph.get_attr(name)
    node.meta = {k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta")}
    if "val" in like.meta:
        fake = node_value(like)
        mode = getattr(fake, "fake_mode", None)
        node.meta["val"] = mode.from_tensor(data, static_shapes=True) if mode is not None else data
    return node


def delete_constant_if_unused(
    graph_module: GraphModule,
    exported_program: ExportedProgram | None,
    node: Node,
) -> bool:
    """Remove a constant node (and its data entry) when nothing reads it any more.

    For `get_attr`, the module attribute is dropped only when no other `get_attr`
    names it; the tensor itself is never touched, so a module sharing it keeps it.
    """
    if node.users or node.graph is not graph_module.graph:
        return False
    if node.op == "placeholder":
        if exported_program is None or exported_program.graph is not node.graph:
            return False
        from executorch.backends.transforms.utils import delete_constant_placeholder

        if constant_tensor(node, exported_program) is None:
            return False
        delete_constant_placeholder(exported_program, node)
        return True
    if node.op != "get_attr":
        return False
    target = str(node.target)
    graph_module.graph.erase_node(node)
    still_read = any(
        n.op == "get_attr" and str(n.target) == target for n in graph_module.graph.nodes
    )
    located = _get_attr_owner(graph_module, target)
    removable = (
        not still_read and located is not None and _owned_by_graph_module(located[0], graph_module)
    )
    if removable and isinstance(getattr(located[0], located[1], None), torch.Tensor):
        delattr(located[0], located[1])
    return True


def _owned_by_graph_module(owner: torch.nn.Module, graph_module: GraphModule) -> bool:
    # torch.export's unlifted modules hold attributes in plain containers made for
    # them; a user's own module class (a traced nn.Conv2d, say) is left alone.
    return owner is graph_module or type(owner) is torch.nn.Module
