# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Last-axis normalizations read a contiguous copy of a channels-last tensor.

    y = layer_norm(x, [W])                  x channels-last (dim order 0,2,3,1)
      -> y = to_channels_last(layer_norm(to_contiguous(x), [W]))

ExecuTorch's portable softmax, log_softmax and layer_norm kernels index their
input as if it were contiguous and do not check its dim order, so a
channels-last input (a delegate's output after `x.to(memory_format=
torch.channels_last)`) is normalized over the wrong axis: a wrong program with
stock ExecuTorch. The copies are exact and XNNPACK delegates them as transposes.
Runs on the ATen program, before decomposition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from etfold.backends.xnnpack._passes.last_axis_normalizations import (
    normalizes_along_memory_axis,
)
from etfold.decisions import Declined, record_applied
from etfold.exir.passes.graph_walk import convert_every_use, insert_to_copy, is_channels_last
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import node_value

FOLD = "xnnpack.contiguous_last_axis_input"

aten = torch.ops.aten


@dataclass(frozen=True)
class ChannelsLastNormalization:
    node: torch.fx.Node
    source: torch.fx.Node
    output_channels_last: bool


def match_channels_last_normalization(
    node: torch.fx.Node,
) -> ChannelsLastNormalization | Declined | None:
    if not normalizes_along_memory_axis(node):
        return None
    source = node.args[0]
    if not isinstance(source, torch.fx.Node) or "val" not in source.meta:
        return Declined(f"`{node.name}` has no tensor metadata on its input")
    if not is_channels_last(node_value(source)):
        return None
    return ChannelsLastNormalization(node, source, is_channels_last(node_value(node)))


VALUE_PRESERVING_COPIES = frozenset(
    {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default}
)


def contiguous_original(source: torch.fx.Node) -> torch.fx.Node | None:
    """A contiguous tensor holding `source`'s values, found by walking back through
    copies that keep dtype and values (`x.to(memory_format=channels_last)`).

    Reading it instead of a new contiguous copy keeps a layout round trip out of
    the graph: a delegate of two copies that cancel would be a pass-through.
    """
    node = source
    while node.op == "call_function" and node.target in VALUE_PRESERVING_COPIES:
        original = node.args[0]
        value, before = node_value(node), node_value(original)
        if not isinstance(before, torch.Tensor) or not isinstance(value, torch.Tensor):
            return None
        if before.dtype != value.dtype or before.shape != value.shape:
            return None
        if before.is_contiguous():
            return original
        node = original
    return None


def rewrite_channels_last_normalization(match: ChannelsLastNormalization) -> None:
    node, graph = match.node, match.node.graph
    contiguous = contiguous_original(match.source)
    with graph.inserting_before(node):
        if contiguous is None:
            contiguous = insert_to_copy(graph, match.source, memory_format=torch.contiguous_format)
        node.replace_input_with(match.source, contiguous)
    node.meta["val"] = node_value(node).contiguous()
    if match.output_channels_last:
        convert_every_use(graph, node, memory_format=torch.channels_last)
    record_applied(
        FOLD,
        node.name,
        f"{node.target} reads a contiguous copy of channels-last `{match.source.name}`: "
        "portable kernels index it as contiguous",
    )


def read_last_axis_normalizations_contiguous(program: ExportedProgram) -> ExportedProgram:
    """The same program back when nothing matches; otherwise a rewritten copy."""
    return rewrite_matches_on_a_copy(
        program, match_channels_last_normalization, rewrite_channels_last_normalization, FOLD
    )
