# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Ops that reduce over the last logical axis read NCHW data inside a delegate.

    softmax(conv(x), dim=-1)             conv output NHWC inside the delegate
      -> softmax(to_nchw(conv(x)), dim=-1)

XNNPACK's softmax normalizes the innermost dimension in memory. Upstream's
`ChannelsLastTaggedReshapePass` keeps a conv's output NHWC through every op it
does not list as layout-sensitive, softmax included, so a softmax over the last
logical axis (W) of a conv output normalizes over C instead: a wrong program,
with stock XNNPACK too. Listing these ops as NCHW-only makes the pass convert
their input back first; that is exact, and costs one transpose.

Upstream keeps the set on the pass class and builds the pass inside
`XnnpackBackend.preprocess`, so the set is extended for the duration of one
preprocess call of a delegate etfold's partitioner marked with `LAYOUT_GUARD_SPEC`,
and for that call's context only: a lowering in another thread meanwhile sees
upstream's set.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from executorch.backends.xnnpack._passes.channels_last_tagged_reshape_pass import (
    ChannelsLastTaggedReshapePass,
)
from executorch.exir.backend.compile_spec_schema import CompileSpec

from etfold.backends.xnnpack._passes.last_axis_normalizations import (
    edge_forms,
    normalizes_along_memory_axis,
)
from etfold.exir.passes.graph_walk import is_channels_last
from etfold.exir.passes.node_shapes import node_value
from etfold.exir.program.reentrant_patch import ReentrantPatch, Replacement

LAYOUT_GUARD_SPEC = CompileSpec("etfold.layout_guard", b"1")

LAST_AXIS_OPS = edge_forms()


class _NchwOpsInThisContext:
    """Stands in for upstream's class-level NCHW-only op set while any guard is open:
    inside a guarded block (this context) it adds LAST_AXIS_OPS, and everywhere else,
    a stock lowering in another thread included, it is upstream's set unchanged."""

    def __init__(self, upstream: set):
        self.upstream = upstream

    def __get__(self, instance, owner=None):
        return self.upstream | LAST_AXIS_OPS if _PATCH.active() else self.upstream


_PATCH = ReentrantPatch(
    "last_axis_ops_read_nchw",
    lambda: [
        Replacement(
            ChannelsLastTaggedReshapePass,
            "memory_sensitive_ops_nchw",
            _NchwOpsInThisContext,
            gated=False,
        )
    ],
)


def _may_produce_nhwc(node: torch.fx.Node) -> bool:
    return (
        node.target in ChannelsLastTaggedReshapePass.memory_sensitive_ops_nhwc
        or is_channels_last(node_value(node))
    )


def _may_be_4d(node: torch.fx.Node) -> bool:
    """Unknown metadata counts as 4-D: the guard is exact either way, so it fails closed."""
    value = node_value(node)
    return not isinstance(value, torch.Tensor) or value.dim() == 4


def needs_layout_guard(nodes: Iterable[torch.fx.Node]) -> bool:
    """A partition holds a last-axis op over a 4-D tensor and something that may be NHWC."""
    members = set(nodes)
    reads_4d = any(
        normalizes_along_memory_axis(n) and _may_be_4d(n.args[0])
        for n in members
        if n.op == "call_function"
    )
    if not reads_4d:
        return False
    inputs = {p for n in members for p in n.all_input_nodes if p not in members}
    return any(_may_produce_nhwc(n) for n in members | inputs)


def has_layout_guard(compile_specs) -> bool:
    return any(spec.key == LAYOUT_GUARD_SPEC.key for spec in compile_specs)


def last_axis_ops_read_nchw() -> contextlib.AbstractContextManager[None]:
    """Extend upstream's NCHW-only op set for the block, in this context only (re-entrant)."""
    return _PATCH.scope()
