# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Each layer a batch norm will fuse into reads constants nothing else reads.

Given:   y1 = bn1(conv(x1, W, b1))      y2 = bn2(conv(x2, W, b2))       (W read by both)
Result:  y1 = bn1(conv(x1, W', b1))     y2 = bn2(conv(x2, W, b2))       (W' a copy of W)

Why: every conv/linear + batch-norm fusion on the way to a delegate stores the
fused values under a name taken from the layer's constants, not the layer.
XNNPACK's `FuseBatchNormPass` and Arm's `FuseBatchNorm2dPass` name the fused
weight after the weight and get back the existing placeholder when a second
layer asks for that name; torchao's `prepare_pt2e` writes the fused weight into
the weight's own attribute, and for the second layer of a shared weight drops
the batch norm without fusing it. So two layers that share a weight or a bias
end with one layer's fused values. With constants of its own, each fused layer
names, and writes, only what it alone reads; the fusions stay upstream's.

The copy holds the same values, so the program computes exactly what it did.
The last fused reader of a constant keeps the original when no other node reads
it, so the fused program carries no extra constant. Layers whose output
something else also reads: the backend fusions leave them unfused, torchao
fuses them anyway and the other reader gets the batch-normed values, so in a
graph module (the form `prepare_pt2e` fuses) the batch norm gets a layer of its
own (`own_constants_in_graph_module`).

A batch norm that fuses into no layer is decomposed instead, and XNNPACK's
`DecomposeBatchNorm` names the decomposition's constants after the batch norm's
weight (gamma): two batch norms sharing a gamma with other statistics got one
norm's values, and one norm applied to two rank-2 tensors gave two conv1d one
weight, which `Conv1dUnsqueezePass` cannot lower. So every batch norm but the
last that reads a gamma another batch norm reads gets a copy of it too:

Given:   bn(x1; g, b1, m1, v1)          bn(x2; g, b2, m2, v2)
Result:  bn(x1; g', b1, m1, v1)         bn(x2; g, b2, m2, v2)

Declines: a constant the program writes (its copy would not follow the writes).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node

from etfold.decisions import Declined, record_applied
from etfold.exir.passes.graph_walk import (
    ConstantSource,
    fresh_constant_name,
    known_placeholder,
    state_facts,
    underlying_op,
)
from etfold.exir.passes.node_rewrite_driver import matches_in
from etfold.exir.program.working_copy import copy_for_rewrite

FOLD = "exir.own_constants_before_batch_norm_fusion"

aten = torch.ops.aten
LAYER_OPS = frozenset(
    {
        aten.conv1d.default,
        aten.conv1d.padding,
        aten.conv2d.default,
        aten.conv2d.padding,
        aten.conv3d.default,
        aten.conv3d.padding,
        aten.conv_transpose1d.default,
        aten.conv_transpose2d.input,
        aten.conv_transpose3d.input,
        aten.convolution.default,
        aten.linear.default,
    }
)
# batch norm at inference, and the argument holding `training` (None: always inference)
INFERENCE_BATCH_NORM_OPS = {
    aten.batch_norm.default: 5,
    aten.native_batch_norm.default: 5,
    aten._native_batch_norm_legit_no_training.default: None,
}
WEIGHT, BIAS = 1, 2
GAMMA = 1  # a batch norm's weight, in every op of INFERENCE_BATCH_NORM_OPS


def is_inference_batch_norm(node: Node) -> bool:
    if node.op != "call_function":
        return False
    op = underlying_op(node.target)
    if op not in INFERENCE_BATCH_NORM_OPS:
        return False
    training = INFERENCE_BATCH_NORM_OPS[op]
    return training is None or (len(node.args) > training and node.args[training] is False)


def fused_layer(batch_norm: Node) -> Node | None:
    """The conv or linear a fusion would fold `batch_norm` into, if any."""
    if not is_inference_batch_norm(batch_norm):
        return None
    layer = batch_norm.args[0]
    if not isinstance(layer, Node) or layer.op != "call_function":
        return None
    return layer if underlying_op(layer.target) in LAYER_OPS else None


def _is_fused_layer(node: Node) -> bool:
    return any(fused_layer(user) is node for user in node.users)


@dataclass(frozen=True)
class LayerNeedsOwnConstants:
    batch_norm: Node
    layer: Node
    positions: tuple[int, ...]  # WEIGHT / BIAS arguments whose constant another node reads
    layer_read_elsewhere: bool  # something besides the batch norm reads the layer's output


def _keeps_original(layer: Node, constant: Node) -> bool:
    """Every reader of `constant` is a fused layer and `layer` is the last of them."""
    readers = list(constant.users)
    return all(_is_fused_layer(r) for r in readers) and readers[-1] is layer


def match_layer_sharing_constants(
    batch_norm: Node, is_constant: Callable[[Node], bool | Declined]
) -> LayerNeedsOwnConstants | Declined | None:
    layer = fused_layer(batch_norm)
    if layer is None:
        return None
    positions = []
    for position in (WEIGHT, BIAS):
        constant = layer.args[position] if len(layer.args) > position else None
        if not isinstance(constant, Node) or len(constant.users) < 2:
            continue
        known = is_constant(constant)
        if isinstance(known, Declined):
            return known
        if known and not _keeps_original(layer, constant):
            positions.append(position)
    read_elsewhere = len(layer.users) > 1
    if not positions and not read_elsewhere:
        return None
    return LayerNeedsOwnConstants(batch_norm, layer, tuple(positions), read_elsewhere)


@dataclass(frozen=True)
class BatchNormSharingGamma:
    batch_norm: Node  # reads a gamma a later batch norm also reads


def match_batch_norm_sharing_gamma(
    batch_norm: Node, is_constant: Callable[[Node], bool | Declined]
) -> BatchNormSharingGamma | Declined | None:
    if not is_inference_batch_norm(batch_norm) or len(batch_norm.args) <= GAMMA:
        return None
    gamma = batch_norm.args[GAMMA]
    if not isinstance(gamma, Node):
        return None
    norms = [user for user in gamma.users if is_inference_batch_norm(user)]
    if len(norms) < 2 or norms[-1] is batch_norm:
        return None
    known = is_constant(gamma)
    if isinstance(known, Declined):
        return known
    return BatchNormSharingGamma(batch_norm) if known else None


def own_constants_before_batch_norm_fusion(program: ExportedProgram) -> ExportedProgram:
    """`program` itself when no fused layer shares a constant; else a copy in which each
    does not. The layers whose output is also read elsewhere are left: the backend
    fusions do not fuse them."""
    matches = _matches(program)
    if not any(isinstance(m, BatchNormSharingGamma) or m.positions for m in matches):
        return program
    program = copy_for_rewrite(program)
    sources = {s.node: s for s in _known_sources(program)}

    def own_copy(reader: Node, position: int) -> None:
        source = sources[reader.args[position]]
        copy = _copy_placeholder(program, source, f"{source.fqn}_for_{reader.name}")
        reader.update_arg(position, copy)

    for match in _matches(program, record=False):
        if isinstance(match, BatchNormSharingGamma):
            own_copy(match.batch_norm, GAMMA)
            record_applied(FOLD, match.batch_norm.name, GAMMA_DETAIL)
            continue
        for position in match.positions:
            own_copy(match.layer, position)
        if match.positions:
            record_applied(FOLD, match.layer.name, _detail(match))
    program.graph_module.recompile()
    return program


GAMMA_DETAIL = (
    "reads its own copy of its weight (gamma): another batch norm reads it, and a"
    " decomposed batch norm's constants are named after its gamma"
)


def _known_sources(program: ExportedProgram) -> list[ConstantSource]:
    facts = state_facts(program)
    found = [known_placeholder(program, n, facts=facts) for n in program.graph.nodes]
    return [s for s in found if isinstance(s, ConstantSource)]


def _matches(
    program: ExportedProgram, record: bool = True
) -> list[LayerNeedsOwnConstants | BatchNormSharingGamma]:
    facts = state_facts(program)

    def is_constant(node: Node) -> bool | Declined:
        if node.op != "placeholder":
            return False
        known = known_placeholder(program, node, facts=facts)
        return known if isinstance(known, Declined) else known is not None

    fold = FOLD if record else None
    return [
        found
        for matcher in (match_layer_sharing_constants, match_batch_norm_sharing_gamma)
        for found in matches_in(program, lambda node, m=matcher: m(node, is_constant), fold)
    ]


def _copy_placeholder(program: ExportedProgram, source: ConstantSource, stem: str) -> Node:
    from executorch.backends.transforms.utils import create_constant_placeholder

    name = fresh_constant_name(program.graph_module, program, stem, source.tensor)
    with program.graph.inserting_after(source.node):
        copy = create_constant_placeholder(
            program,
            program.graph,
            name,
            source.kind,
            source.tensor.detach().clone(),
            source.persistent,
        )
    copy.meta.update({k: v for k, v in source.node.meta.items() if k != "val"})
    return copy


def _detail(match: LayerNeedsOwnConstants) -> str:
    names = {WEIGHT: "weight", BIAS: "bias"}
    owned = " and ".join(names[p] for p in match.positions)
    return f"reads its own copy of its {owned} before `{match.batch_norm.name}` fuses into it"


def own_constants_in_graph_module(graph_module: GraphModule) -> bool:
    """The same, in place, on a graph module whose constants are attributes (what
    torchao's `prepare_pt2e` fuses). A layer whose output something else also reads is
    duplicated for its batch norm, with constants of its own. True if anything changed."""
    graph = graph_module.graph
    changed = False
    for node in list(graph.nodes):
        match = match_layer_sharing_constants(node, lambda n: n.op == "get_attr")
        if isinstance(match, Declined) or match is None:
            continue
        layer = _layer_of_its_own(graph, match) if match.layer_read_elsewhere else match.layer
        positions = (WEIGHT, BIAS) if match.layer_read_elsewhere else match.positions
        for position in positions:
            constant = layer.args[position] if len(layer.args) > position else None
            if isinstance(constant, Node) and constant.op == "get_attr":
                copy = _copy_attribute(
                    graph_module, constant, f"{constant.target}_for_{layer.name}"
                )
                layer.update_arg(position, copy)
        record_applied(FOLD, match.layer.name, _graph_module_detail(match))
        changed = True
    if changed:
        graph_module.recompile()
    return changed


def _layer_of_its_own(graph: torch.fx.Graph, match: LayerNeedsOwnConstants) -> Node:
    with graph.inserting_after(match.layer):
        layer = graph.node_copy(match.layer)
    match.batch_norm.replace_input_with(match.layer, layer)
    return layer


def _copy_attribute(graph_module: GraphModule, constant: Node, stem: str) -> Node:
    value = operator.attrgetter(constant.target)(graph_module)
    copied = value.detach().clone()
    name = fresh_constant_name(graph_module, None, stem, copied)
    if isinstance(value, torch.nn.Parameter):
        graph_module.register_parameter(name, torch.nn.Parameter(copied, value.requires_grad))
    else:
        graph_module.register_buffer(name, copied)
    with graph_module.graph.inserting_after(constant):
        node = graph_module.graph.get_attr(name)
    node.meta.update(constant.meta)
    return node


def _graph_module_detail(match: LayerNeedsOwnConstants) -> str:
    if match.layer_read_elsewhere:
        return (
            f"`{match.batch_norm.name}` fuses into a copy of the layer with constants of its own:"
            " another node also reads the layer's output"
        )
    return _detail(match)
