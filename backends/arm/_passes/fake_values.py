# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Fake values (meta["val"]) on every node, for matchers that read shapes and dtypes."""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from etfold.decisions import Declined
from etfold.exir.passes.node_shapes import node_value


def ensure_fake_values(graph_module: GraphModule) -> Declined | None:
    """Give every node a fake value (meta["val"]) if any lacks one; Declined if impossible.

    Matchers read shapes and dtypes from meta["val"]; a graph built by hand, or
    left by a pass that did not retrace, may carry them only on its placeholders.
    Propagation runs in a fresh fake mode from zero tensors of the placeholders'
    static shapes (get_attr constants are read as they are).
    """
    nodes = [n for n in graph_module.graph.nodes if n.op in ("placeholder", "call_function")]
    if all("val" in n.meta for n in nodes):
        return None
    values = [node_value(n) for n in nodes if n.op == "placeholder"]
    if not all(
        isinstance(v, torch.Tensor) and all(type(d) is int for d in v.shape) for v in values
    ):
        return Declined(
            "no fake values to propagate: the graph's placeholders carry no static meta['val']"
        )
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    inputs = [torch.zeros(tuple(v.shape), dtype=v.dtype) for v in values]
    try:
        FakeTensorProp(graph_module, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    except Exception as error:  # noqa: BLE001 - any failure means: decline, never guess shapes
        return Declined(
            f"could not propagate fake values through the graph ({type(error).__name__}: {error})"
        )
    return None
