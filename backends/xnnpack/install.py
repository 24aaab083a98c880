"""The one install step behind delegated dtype converts.

Upstream has no hook in `XnnpackBackend.preprocess` and its backend lookup is by
class name, so etfold wraps that static method. The wrapper acts only on
programs that etfold's partitioner marked with the `DTYPE_CONVERTS_SPEC`
compile spec: it runs `RewriteDtypeCopiesAsConvertsPass` first, then upstream's
preprocess unchanged. Unmarked programs go straight to upstream's preprocess
with the same arguments, so stock lowering serializes byte-identically.
`XNNConvertVisitor` enters upstream's node-visitor registry under a target that
only marked delegates contain.

Nothing happens at import. `install()` is idempotent, `uninstall()` restores
upstream exactly, and both raise `UpstreamShapeError` when upstream no longer
looks like what this module was written against.
"""

from __future__ import annotations

import contextlib
import inspect
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


class UpstreamShapeError(RuntimeError):
    """Upstream ExecuTorch changed in a way this install step was not written for."""


def _wants_dtype_converts(compile_specs) -> bool:
    return any(spec.key == DTYPE_CONVERTS_SPEC.key for spec in compile_specs)


def _marked_preprocess(edge_program, compile_specs):
    with contextlib.ExitStack() as scope:
        if has_layout_guard(compile_specs):
            scope.enter_context(last_axis_ops_read_nchw())
        if _wants_dtype_converts(compile_specs):
            RewriteDtypeCopiesAsConvertsPass()(edge_program.graph_module)
        return _marked_preprocess.upstream(edge_program, compile_specs)


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


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Install for the block; restore the previous state after it."""
    was_installed = is_installed()
    install()
    try:
        yield
    finally:
        if not was_installed:
            uninstall()
