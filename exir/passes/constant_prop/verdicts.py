# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""May this fold: the one answer every constant fold asks (constant_prop_pass, the
XNNPACK weight fold), each question a `Declined | None` (or value) predicate.

    source_verdict   may a fold read this placeholder's value (ConstantSource),
                     Declined with why, or None for a user input
    op_verdict       may this op run at export time instead of on every call
    agreed_custom    the `custom` meta (external-file tags) a fold's inputs share

A placeholder's value is a fact (`graph_walk.known_placeholder`); whether a fold may
read it is policy (`SourcePolicy`): buffers at all, and whether the cross-method marks
of `exir/program` count (a constant several methods read is stored once per method if
folded; a buffer no one judged across methods may be written by another method).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from executorch.exir import memory
from executorch.exir.passes.constant_prop_pass import (
    _DEFAULT_SKIP_TARGETS as UPSTREAM_DEFAULT_SKIP_TARGETS,
)
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from etfold.decisions import Declined
from etfold.exir.passes.graph_walk import (
    ConstantSource,
    StateFacts,
    known_placeholder,
    op_namespace,
    op_qualified_name,
    placeholders,
    state_facts,
    underlying_op,
)
from etfold.exir.program.buffer_marks import BUFFER_FOLD_BLOCKERS
from etfold.exir.program.method_marks import SHARED_ACROSS_METHODS

# ---------------------------------------------------------------- sources


@dataclass(frozen=True)
class SourcePolicy:
    """Which known values a fold may read.

    fold_buffers: buffers count at all.
    across_methods: honour the marks `etfold.exir.to_edge_transform_and_lower` (or the
        partitioner inside upstream's entry point) leaves: a constant several methods
        read never folds, and a buffer folds only when judged unwritten by every method.
    """

    fold_buffers: bool = True
    across_methods: bool = False


ONE_METHOD = SourcePolicy()
EVERY_METHOD = SourcePolicy(across_methods=True)


def source_verdict(
    ep: ExportedProgram,
    node: torch.fx.Node,
    policy: SourcePolicy = ONE_METHOD,
    facts: StateFacts | None = None,
) -> ConstantSource | Declined | None:
    """The source a fold may read, Declined with why, or None: not a parameter, buffer or
    constant (a user input). `facts` is `state_facts(ep)` when asking about many."""
    facts = facts or state_facts(ep)
    spec = facts.specs.get(node.name)
    if policy.across_methods and spec is not None and node.meta.get(SHARED_ACROSS_METHODS):
        return Declined(f"`{spec.target}` is read by several methods")
    found = known_placeholder(ep, node, facts=facts)
    if not isinstance(found, ConstantSource) or found.kind != InputKind.BUFFER:
        return found
    if not policy.fold_buffers:
        return Declined(f"buffer {found.fqn} (fold_buffers=False)")
    if policy.across_methods:
        return _judged_across_methods(found)
    return found


def _judged_across_methods(source: ConstantSource) -> ConstantSource | Declined:
    blockers = source.node.meta.get(BUFFER_FOLD_BLOCKERS)
    if blockers is None:
        return Declined(
            f"buffer `{source.fqn}` was not judged across methods (lower through "
            "etfold.exir.to_edge_transform_and_lower to fold buffers)"
        )
    if blockers:
        return Declined(f"buffer `{source.fqn}`: {'; '.join(blockers)}")
    return source


def constant_sources(
    ep: ExportedProgram, policy: SourcePolicy = ONE_METHOD
) -> tuple[dict[torch.fx.Node, ConstantSource], dict[torch.fx.Node, str]]:
    """Placeholders a fold may read, and the reason each other state placeholder may not."""
    facts = state_facts(ep)
    known: dict[torch.fx.Node, ConstantSource] = {}
    excluded: dict[torch.fx.Node, str] = {}
    for node in placeholders(ep):
        found = source_verdict(ep, node, policy, facts)
        if isinstance(found, ConstantSource):
            known[node] = found
        elif found is not None:
            excluded[node] = found.reason
    return known, excluded


# ---------------------------------------------------------------- ops

# Factory ops that only fill a tensor with one value: folding one stores the fill.
FILL_FACTORIES = frozenset(
    {
        "full",
        "full_like",
        "new_full",
        "ones",
        "ones_like",
        "new_ones",
        "zeros",
        "zeros_like",
        "new_zeros",
    }
)
# Their contents are undefined until written.
ALLOCATIONS = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
)
QUANT_NAMESPACES = frozenset({"quantized_decomposed", "torchao"})


def _packet_name(target) -> str | None:
    op = underlying_op(target)
    return op.overloadpacket.__name__ if isinstance(op, torch._ops.OpOverload) else None


def is_impure(node: torch.fx.Node) -> bool:
    """Side effects (mutation, asserts, prints); randomness is `is_nondeterministic`."""
    return node.is_impure(impure_random=False)


def is_nondeterministic(node: torch.fx.Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(underlying_op(node.target), "tags", ())


def allocates_memory(node: torch.fx.Node) -> bool:
    return node.target is memory.alloc or _packet_name(node.target) in ALLOCATIONS


def is_fill_factory(node: torch.fx.Node) -> bool:
    """An op whose values do not depend on any input's data: `full`, `ones_like`, ...,
    `fill.Scalar`, and `scalar_tensor` of a literal (of a computed scalar it carries data)."""
    name = _packet_name(node.target)
    if name in FILL_FACTORIES or op_qualified_name(node.target) == "aten.fill.Scalar":
        return True
    return name == "scalar_tensor" and not node.all_input_nodes


# fill factories whose fill is implied by the op, and where the others take it
_IMPLIED_FILLS = {
    "zeros": 0,
    "zeros_like": 0,
    "new_zeros": 0,
    "ones": 1,
    "ones_like": 1,
    "new_ones": 1,
}
_FILL_AT = {"full": 1, "full_like": 1, "new_full": 2, "scalar_tensor": 0, "fill": 1}


def filled_with(node: torch.fx.Node) -> int | float | None:
    """The one number a fill factory fills every element with (`full_like(x, 0.5)`: 0.5,
    `zeros_like(x)`: 0); None for any other node, or a fill that is not a plain number."""
    if node.op != "call_function" or not is_fill_factory(node):
        return None
    name = _packet_name(node.target)
    if name in _IMPLIED_FILLS:
        return _IMPLIED_FILLS[name]
    at = _FILL_AT.get(name)
    fill = node.args[at] if at is not None and len(node.args) > at else node.kwargs.get("value")
    if isinstance(fill, bool) or not isinstance(fill, (int, float)):
        return None
    return fill


def is_quant_primitive(node: torch.fx.Node) -> bool:
    return op_namespace(node.target) in QUANT_NAMESPACES


def is_known_pure_target(node: torch.fx.Node) -> bool:
    """An ATen/Edge/custom op (judged by its schema) or one of Python's `operator` builtins;
    anything else (a higher-order op, an arbitrary callable) may do what no schema says."""
    target = node.target
    return (
        isinstance(underlying_op(target), torch._ops.OpOverload)
        or getattr(target, "__module__", None) == "_operator"
    )


@dataclass(frozen=True)
class SkipFamilies:
    """Skip targets named by family, in every dialect, each with its own reason."""

    fills: bool = True
    quantization: bool = True

    def decline(self, node: torch.fx.Node) -> Declined | None:
        if self.fills and is_fill_factory(node):
            return Declined("factory op that only fills a tensor")
        if self.quantization and is_quant_primitive(node):
            return Declined("quantization primitive: the Q/DQ chain stays as it came")
        return None


FILLS_AND_QUANT_OPS = SkipFamilies()

SkipTargets = Collection | SkipFamilies | None


def op_verdict(node: torch.fx.Node, skip: SkipTargets) -> Declined | None:
    """Why `node` must not be computed at export time, or None.

    Never: a node that is not a call of a known-pure target, an impure,
    nondeterministic (RNG) or allocating op (that would freeze a side effect, one
    random draw or uninitialised memory). Beyond those, `skip`: None is upstream's
    default set, a `SkipFamilies` skips by family, a collection names targets."""
    if node.op != "call_function":
        return Declined(f"a {node.op} node")
    if allocates_memory(node):
        return Declined("memory allocation op")
    if not is_known_pure_target(node):
        return Declined(f"{node.target} is not an ATen op")
    if is_impure(node):
        return Declined("impure op")
    if is_nondeterministic(node):
        return Declined("nondeterministic op (nondeterministic_seeded)")
    if isinstance(skip, SkipFamilies):
        return skip.decline(node)
    if skip is None:
        if node.target in UPSTREAM_DEFAULT_SKIP_TARGETS:
            return Declined(f"{op_qualified_name(node.target)} is a default skip target")
        return None
    if node.target in skip or underlying_op(node.target) in skip:
        return Declined("in custom_skip_targets")
    return None


# ---------------------------------------------------------------- custom meta

UNSET = object()  # a value computed from no source: it takes no side on `custom` meta


def source_custom(node: torch.fx.Node) -> dict:
    """A source's `custom` meta; none ({}) means its data lives in the program itself."""
    return dict(node.meta.get("custom") or {})


def agreed_custom(nodes: Iterable[torch.fx.Node], custom_of: Callable[[torch.fx.Node], Any]):
    """The `custom` meta every node agrees on (UNSET: none takes a side), or a Declined.

    `custom_of` gives a source's own (`source_custom`) and a folded value what its
    sources agreed on. A tagged source and an untagged one disagree: the fold would
    move the untagged data into the tagged file (or the tagged data into the program),
    changing what a file shared by several programs holds."""
    agreed, first = UNSET, None
    for node in nodes:
        value = custom_of(node)
        if value is UNSET:
            continue
        if agreed is UNSET:
            agreed, first = value, node
        elif value != agreed:
            return Declined(
                f"`{first.name}` and `{node.name}` disagree on their `custom` meta "
                f"(external-file tags {agreed!r} vs {value!r})"
            )
    return agreed
