# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The one install step behind delegated dtype converts and the layout guard.

Upstream has no hook in `XnnpackBackend.preprocess` and its backend lookup is by
class name, so etfold wraps that static method. The wrapper acts only on
programs that etfold's partitioner marked with a compile spec
(`DTYPE_CONVERTS_SPEC`, the layout guard); unmarked programs go straight to
upstream's preprocess with the same arguments, so stock lowering serializes
byte-identically. `XNNConvertVisitor` enters upstream's node-visitor registry
under a target that only marked delegates contain.

The install is held, never left behind: etfold's partitioner takes one hold per
marked partition it returns, and the wrapper gives each back once that
partition is preprocessed; etfold's `to_edge_transform_and_lower` also gives
back, when it returns or raises, every hold taken during its call. When the
last hold goes, upstream is restored exactly. Nothing happens at import.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import threading
from collections.abc import Iterator

from executorch.backends.xnnpack._passes.channels_last_tagged_reshape_pass import (
    ChannelsLastTaggedReshapePass,
)
from executorch.backends.xnnpack.operators import node_visitor
from executorch.backends.xnnpack.serialization import xnnpack_graph_schema
from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend
from executorch.exir.backend.compile_spec_schema import CompileSpec

from etfold.backends.xnnpack._passes.dtype_convert_match import CONVERT_TARGET
from etfold.backends.xnnpack._passes.last_axis_ops_read_nchw import (
    has_layout_guard,
    last_axis_ops_read_nchw,
)
from etfold.backends.xnnpack._passes.rewrite_dtype_copies_as_converts_pass import (
    RewriteDtypeCopiesAsConvertsPass,
)
from etfold.backends.xnnpack.operators.op_convert import XNNConvertVisitor

DTYPE_CONVERTS_SPEC = CompileSpec("etfold.dtype_converts", b"1")

_PREPROCESS_PARAMETERS = ["edge_program", "compile_specs"]

# the staticmethod object install() replaced, put back as is by uninstall()
_upstream: dict[str, staticmethod] = {}

_lock = threading.RLock()
_holds = 0
_installed_by_holds = False  # False when install() was called directly: holds leave it be
# holds taken inside one etfold lowering call and not yet given back: [count]
_call_holds: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "etfold_xnnpack_call_holds", default=None
)


class UpstreamShapeError(RuntimeError):
    """Upstream ExecuTorch changed in a way this install step was not written for."""


def _wants_dtype_converts(compile_specs) -> bool:
    return any(spec.key == DTYPE_CONVERTS_SPEC.key for spec in compile_specs)


def is_marked(compile_specs) -> bool:
    """The partition carries a spec that etfold's preprocess wrapper acts on."""
    return _wants_dtype_converts(compile_specs) or has_layout_guard(compile_specs)


def _marked_preprocess(edge_program, compile_specs):
    if not is_marked(compile_specs):
        return _marked_preprocess.upstream(edge_program, compile_specs)
    try:
        with contextlib.ExitStack() as scope:
            if has_layout_guard(compile_specs):
                scope.enter_context(last_axis_ops_read_nchw())
            if _wants_dtype_converts(compile_specs):
                RewriteDtypeCopiesAsConvertsPass()(edge_program.graph_module)
            return _marked_preprocess.upstream(edge_program, compile_specs)
    finally:
        release()


def _registry() -> dict:
    registry = getattr(node_visitor, "_node_visitor_dict", None)
    if not isinstance(registry, dict):
        raise UpstreamShapeError(
            "executorch.backends.xnnpack.operators.node_visitor._node_visitor_dict is gone; "
            "etfold cannot register XNNConvertVisitor"
        )
    return registry


def check_upstream_shape() -> None:
    """Raise `UpstreamShapeError` unless upstream still offers what install() relies on."""
    preprocess = inspect.getattr_static(XnnpackBackend, "preprocess", None)
    if not isinstance(preprocess, staticmethod):
        raise UpstreamShapeError("XnnpackBackend.preprocess is no longer a staticmethod")
    parameters = list(inspect.signature(preprocess.__func__).parameters)
    if parameters != _PREPROCESS_PARAMETERS:
        raise UpstreamShapeError(
            f"XnnpackBackend.preprocess takes {parameters}, etfold expects {_PREPROCESS_PARAMETERS}"
        )
    registry = _registry()
    if "aten._to_copy.default" not in registry:
        raise UpstreamShapeError("upstream no longer registers a visitor for aten._to_copy.default")
    owner = registry.get(XNNConvertVisitor.target)
    if owner is not None and owner is not XNNConvertVisitor:
        raise UpstreamShapeError(
            f"upstream now registers {owner.__name__} for {XNNConvertVisitor.target}; "
            "etfold's XNNConvertVisitor would replace it"
        )
    if not hasattr(xnnpack_graph_schema, "XNNConvert"):
        raise UpstreamShapeError("the XNNPACK schema has no XNNConvert node")
    layout_sensitive = (
        ChannelsLastTaggedReshapePass.memory_sensitive_ops_nhwc
        | ChannelsLastTaggedReshapePass.memory_sensitive_ops_nchw
    )
    if CONVERT_TARGET in layout_sensitive:
        raise UpstreamShapeError(
            "ChannelsLastTaggedReshapePass now pins a layout on prims.convert_element_type"
        )


def _preprocess_is_wrapped() -> bool:
    preprocess = inspect.getattr_static(XnnpackBackend, "preprocess", None)
    return isinstance(preprocess, staticmethod) and preprocess.__func__ is _marked_preprocess


def is_installed() -> bool:
    return (
        _preprocess_is_wrapped() and _registry().get(XNNConvertVisitor.target) is XNNConvertVisitor
    )


def install() -> None:
    """Wrap XnnpackBackend.preprocess and register XNNConvertVisitor (idempotent)."""
    if is_installed():
        return
    check_upstream_shape()
    if not _preprocess_is_wrapped():
        original = inspect.getattr_static(XnnpackBackend, "preprocess")
        _upstream["preprocess"] = original
        _marked_preprocess.upstream = original.__func__
        XnnpackBackend.preprocess = staticmethod(_marked_preprocess)
    node_visitor.register_node_visitor(XNNConvertVisitor)


def uninstall() -> None:
    """Put upstream back exactly as it was (no-op when not installed)."""
    if _preprocess_is_wrapped():
        XnnpackBackend.preprocess = _upstream.pop("preprocess")
    registry = _registry()
    if registry.get(XNNConvertVisitor.target) is XNNConvertVisitor:
        del registry[XNNConvertVisitor.target]


def acquire(count: int = 1) -> None:
    """Take `count` holds on the install; the first hold installs."""
    global _holds, _installed_by_holds
    if count <= 0:
        return
    with _lock:
        if _holds == 0:
            _installed_by_holds = not is_installed()
        install()  # idempotent; puts back a wrapper a direct uninstall() dropped
        _holds += count
    taken = _call_holds.get()
    if taken is not None:
        taken[0] += count


def release(count: int = 1) -> None:
    """Give back `count` holds; the last one restores upstream."""
    global _holds
    with _lock:
        count = min(count, _holds)
        if count == 0:
            return
        _holds -= count
        if _holds == 0 and _installed_by_holds:
            uninstall()
    taken = _call_holds.get()
    if taken is not None:
        taken[0] = max(0, taken[0] - count)


def holds() -> int:
    return _holds


@contextlib.contextmanager
def holds_released_on_exit() -> Iterator[None]:
    """Around one lowering call: the holds its partitions took and its preprocess
    calls did not give back (the lowering raised, or never preprocessed) go too."""
    token = _call_holds.set([0])
    try:
        yield
    finally:
        left = _call_holds.get()[0]
        _call_holds.reset(token)
        release(left)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Installed for the block (one hold); restored after it unless others hold it."""
    acquire()
    try:
        yield
    finally:
        release()
