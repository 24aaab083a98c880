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

The install is held, never left behind. etfold's partitioner takes one hold per
marked partition it returns, on a ledger tied to the program it partitioned:
the wrapper gives one back as each marked partition is preprocessed; when a
preprocess raises, the lowering is over and every ledger of its context goes;
when the lowering raises anywhere else, the ledger goes with the partitioned
program (at the latest when the garbage collector takes it: the graph holds
reference cycles), and at once when the lowering went through etfold's
`to_edge_transform_and_lower`, whose scope closes the ledgers opened during it.
When the last hold goes, upstream is restored exactly. Nothing happens at import.

Why the install is process-wide while held: upstream finds the preprocess by class
and the visitor by target, one value for every thread. Neither acts on anyone else's
program: the wrapper hands every unmarked program to upstream's preprocess unchanged,
and the visitor's target occurs only in delegates etfold's partitioner marked.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

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
from etfold.backends.xnnpack.operators.op_dynamic_slice import DynamicSliceVisitor
from etfold.backends.xnnpack.partition.config.dynamic_slice_config import has_dynamic_slices
from etfold.exir.program.lowering_scopes import register_lowering_scope

DTYPE_CONVERTS_SPEC = CompileSpec("etfold.dtype_converts", b"1")

_PREPROCESS_PARAMETERS = ["edge_program", "compile_specs"]

# the staticmethod object install() replaced, put back as is by uninstall()
_upstream: dict[str, staticmethod] = {}

_lock = threading.RLock()
_holds = 0
_installed_by_holds = False  # False when install() was called directly: holds leave it be


@dataclass(eq=False)
class Ledger:
    """The holds taken for one partitioned program that are not given back yet."""

    left: int
    generation: int = 0  # holds from before a reset_holds() are no longer anyone's


_generation = 0


# the open ledgers of this context (one thread's lowering), oldest first
_ledgers: contextvars.ContextVar[list[Ledger] | None] = contextvars.ContextVar(
    "etfold_xnnpack_ledgers", default=None
)


class UpstreamShapeError(RuntimeError):
    """Upstream ExecuTorch changed in a way this install step was not written for."""


def _wants_dtype_converts(compile_specs) -> bool:
    return any(spec.key == DTYPE_CONVERTS_SPEC.key for spec in compile_specs)


def is_marked(compile_specs) -> bool:
    """The partition carries a spec that etfold's preprocess wrapper acts on."""
    return (
        _wants_dtype_converts(compile_specs)
        or has_layout_guard(compile_specs)
        or has_dynamic_slices(compile_specs)
    )


def _marked_preprocess(edge_program, compile_specs):
    if not is_marked(compile_specs):
        return _marked_preprocess.upstream(edge_program, compile_specs)
    try:
        with contextlib.ExitStack() as scope:
            if has_layout_guard(compile_specs):
                scope.enter_context(last_axis_ops_read_nchw())
            if _wants_dtype_converts(compile_specs):
                RewriteDtypeCopiesAsConvertsPass()(edge_program.graph_module)
            result = _marked_preprocess.upstream(edge_program, compile_specs)
    except BaseException:
        _close_all(_ledgers.get())  # the lowering this preprocess belongs to is over
        raise
    _give_back_one()
    return result


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
    if not issubclass(DynamicSliceVisitor, registry.get(DynamicSliceVisitor.target, object)):
        raise UpstreamShapeError(
            "upstream's slice visitor is not the one DynamicSliceVisitor extends"
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
    registry = _registry()
    return (
        _preprocess_is_wrapped()
        and registry.get(XNNConvertVisitor.target) is XNNConvertVisitor
        and registry.get(DynamicSliceVisitor.target) is DynamicSliceVisitor
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
    # a static slice is serialized as upstream's visitor does; a dynamic one resizes
    if _registry()[DynamicSliceVisitor.target] is not DynamicSliceVisitor:
        _upstream["slice_visitor"] = _registry()[DynamicSliceVisitor.target]
        node_visitor.register_node_visitor(DynamicSliceVisitor)


def uninstall() -> None:
    """Put upstream back exactly as it was (no-op when not installed)."""
    if _preprocess_is_wrapped():
        XnnpackBackend.preprocess = _upstream.pop("preprocess")
    registry = _registry()
    if registry.get(XNNConvertVisitor.target) is XNNConvertVisitor:
        del registry[XNNConvertVisitor.target]
    if "slice_visitor" in _upstream:
        registry[DynamicSliceVisitor.target] = _upstream.pop("slice_visitor")


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


def holds() -> int:
    return _holds


def hold_for(program: object, count: int) -> Ledger:
    """`count` holds for the partitions of `program`, given back as they are preprocessed,
    or all at once when the lowering raises or `program` is gone."""
    if count <= 0:
        return Ledger(0)
    with _lock:
        acquire(count)
        ledger = Ledger(count, _generation)
        open_ledgers = _ledgers.get()
        if open_ledgers is None:
            open_ledgers = []
            _ledgers.set(open_ledgers)
        open_ledgers.append(ledger)
    weakref.finalize(program, _close, ledger, open_ledgers)
    return ledger


def _close(ledger: Ledger, open_ledgers: list[Ledger]) -> None:
    with _lock:
        left, ledger.left = ledger.left, 0
        if ledger in open_ledgers:
            open_ledgers.remove(ledger)
        if ledger.generation == _generation:
            release(left)


def reset_holds() -> None:
    """Drop every hold, whoever took it, and restore upstream if holds installed it; the
    ledgers open now give nothing back later (for a test that must start clean)."""
    global _generation
    with _lock:
        _generation += 1
        release(_holds)


def _close_all(open_ledgers: list[Ledger] | None) -> None:
    for ledger in list(open_ledgers or ()):
        _close(ledger, open_ledgers)


def _give_back_one() -> None:
    """One marked partition was preprocessed: one hold of the oldest open ledger goes."""
    with _lock:
        open_ledgers = _ledgers.get() or []
        ledger = next((entry for entry in open_ledgers if entry.left), None)
        if ledger is None:
            return
        ledger.left -= 1
        if not ledger.left:
            open_ledgers.remove(ledger)
        if ledger.generation == _generation:
            release(1)


@contextlib.contextmanager
def holds_released_on_exit() -> Iterator[None]:
    """Around one lowering call: the ledgers opened during it close when it returns or
    raises, whatever its partitions' preprocess calls did not give back."""
    token = _ledgers.set([])
    try:
        yield
    finally:
        opened = _ledgers.get()
        _ledgers.reset(token)
        _close_all(opened)


register_lowering_scope(holds_released_on_exit)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Installed for the block (one hold); restored after it unless others hold it."""
    acquire()
    try:
        yield
    finally:
        release()
