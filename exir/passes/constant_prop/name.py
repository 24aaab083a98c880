# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Name: what each folded result becomes, and under which name and kind.

    folded n, every reader folded too          -> erased
    folded n, a tensor read outside the fold    -> constant placeholder
    folded n, a non-tensor read outside it      -> stays an op (its value is not stored)

`register_like_source=False` (upstream's naming): a lifted constant, named
`_prop_tensor_constant{N}` when the rewrite registers it. `True`: registered like
its sources (PARAMETER if any source is one, else BUFFER if any is, else a
lifted constant), with their agreed `custom` meta, named
`<first source of that kind>_prop_<sha256 of the expression>`: the same
expression over the same source gets the same name in every method. A fold of a
folded constant keeps one suffix: it is named from the first fold's root, with the
digest of the new expression (whose source line names the first fold, so the
digest still covers the whole computation).

That name is the stem of `graph_walk.constant_names`, etfold's one naming rule: a
program already holding the same data under it shares that constant (the same
fold, found twice); one holding other data under it gives the fold the next name,
`<stem>_<digest of the data>`. Upstream's naming, a counter, is upstream's
default and stays its own.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from etfold.decisions import Declined, record_declined
from etfold.exir.passes.constant_prop import FOLD
from etfold.exir.passes.constant_prop.evaluate import Evaluation, fresh_constant, storage_key
from etfold.exir.passes.constant_prop.select import Selection
from etfold.exir.passes.constant_prop.verdicts import UNSET
from etfold.exir.passes.graph_walk import (
    NAME_DIGEST_LENGTH,
    ConstantSource,
    constant_names,
    equal_tensors,
    is_plain_tensor,
    op_qualified_name,
)
from etfold.exir.program.buffer_marks import BUFFER_FOLD_BLOCKERS

UPSTREAM_PREFIX = "_prop_tensor_constant"
_FOLD_SUFFIX = re.compile(rf"_prop_[0-9a-f]{{64}}(_[0-9a-f]{{{NAME_DIGEST_LENGTH}}})?$")
_UPSTREAM_NAME = re.compile(rf"^{UPSTREAM_PREFIX}[0-9]+$")


def fold_root(fqn: str) -> str:
    """The name a fold of `fqn` starts from: a folded constant's own root, so a constant
    folded twice keeps one `_prop_` suffix."""
    return _FOLD_SUFFIX.sub("", fqn)


def is_folded_target(target: str) -> bool:
    """Whether a state or constant target is one constant propagation created
    (either naming: etfold's `<root>_prop_<digest>` or upstream's `_prop_tensor_constant<N>`)."""
    return bool(_FOLD_SUFFIX.search(target) or _UPSTREAM_NAME.match(target))


@dataclass(frozen=True)
class Materialization:
    """One folded node that becomes a constant placeholder."""

    node: torch.fx.Node
    kind: InputKind
    target: str | None  # None: named upstream's way at registration
    persistent: bool | None
    custom: dict | None
    tensor: torch.Tensor
    ops_folded: int
    # a folded buffer's fold verdict, carried from its buffer sources (None: not judged)
    buffer_fold_blockers: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ConstantFolds:
    """The match: what becomes a constant, what is erased, which sources the fold reads."""

    materialize: tuple[Materialization, ...]
    erase: tuple[torch.fx.Node, ...]  # folded nodes nothing outside the fold reads
    sources: tuple[torch.fx.Node, ...]  # source placeholders the fold reads, in graph order
    fold_buffers: bool


def _describe(value, index: Mapping[torch.fx.Node, int]) -> str:
    if isinstance(value, torch.fx.Node):
        return f"#{index[value]}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_describe(v, index) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        items = ", ".join(f"{k!r}: {_describe(value[k], index)}" for k in sorted(value, key=repr))
        return "{" + items + "}"
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return f"{type(value).__name__}:{value}"
    return repr(value)


def _source_line(position: int, source: ConstantSource) -> str:
    shape = "x".join(str(d) for d in source.tensor.shape)
    kind = source.kind.name.lower()
    return f"#{position} = {kind} {source.fqn} {source.tensor.dtype}[{shape}]"


def _op_line(position: int, node: torch.fx.Node, index: Mapping[torch.fx.Node, int]) -> str:
    args = ", ".join(
        [_describe(a, index) for a in node.args]
        + [f"{k}={_describe(node.kwargs[k], index)}" for k in sorted(node.kwargs)]
    )
    return f"#{position} = {op_qualified_name(node.target)}({args})"


def fold_expression(
    node: torch.fx.Node, sources: Mapping[torch.fx.Node, ConstantSource]
) -> tuple[str, list[ConstantSource]]:
    """The expression computing `node` from its sources, and those sources in order.

    Each producer is described once, in post-order from `node` following inputs in
    argument order, and referenced by index afterwards: the text is linear in the
    number of producers and independent of node names and graph order.
    """
    index: dict[torch.fx.Node, int] = {}
    lines: list[str] = []
    leaves: list[ConstantSource] = []
    stack: list[tuple[torch.fx.Node, bool]] = [(node, False)]
    while stack:
        current, inputs_done = stack.pop()
        if current in index:
            continue
        source = sources.get(current)
        if source is None and not inputs_done:
            stack.append((current, True))
            stack.extend((p, False) for p in reversed(current.all_input_nodes) if p not in index)
            continue
        index[current] = len(lines)
        if source is not None:
            lines.append(_source_line(len(lines), source))
            leaves.append(source)
        else:
            lines.append(_op_line(len(lines), current, index))
    lines.append(f"result #{index[node]}")
    return "\n".join(lines), leaves


def _registered_kind(leaves: Iterable[ConstantSource]) -> tuple[InputKind, ConstantSource | None]:
    leaves = list(leaves)
    for kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
        for leaf in leaves:
            if leaf.kind == kind:
                return kind, leaf
    return InputKind.CONSTANT_TENSOR, None


def _name_taken_by_other_data(ep: ExportedProgram, target: str, tensor: torch.Tensor) -> bool:
    existing = ep.state_dict.get(target, ep.constants.get(target))
    return existing is not None and not equal_tensors(existing, tensor)


def stored_and_erased(evaluation: Evaluation) -> tuple[list[torch.fx.Node], set[torch.fx.Node]]:
    """The folded nodes that become placeholders (graph order), and those that go away."""
    removed: set[torch.fx.Node] = set()
    stored: list[torch.fx.Node] = []
    for node in reversed(evaluation.folded):
        if all(u in removed for u in node.users):
            removed.add(node)
        elif is_plain_tensor(evaluation.values[node]):
            removed.add(node)
            stored.append(node)
        else:
            record_declined(
                FOLD,
                node.name,
                f"non-tensor result ({type(evaluation.values[node]).__name__}) read outside "
                "the fold stays an op",
            )
    stored.reverse()
    return stored, removed - set(stored)


def carried_blockers(leaves: Iterable[ConstantSource]) -> tuple[str, ...] | None:
    """A buffer folded from buffers is judged as they were: every buffer source's
    cross-method verdict, joined; None when some source was never judged."""
    verdicts = [leaf.node.meta.get(BUFFER_FOLD_BLOCKERS) for leaf in leaves]
    verdicts = [
        v for v, leaf in zip(verdicts, leaves, strict=True) if leaf.kind == InputKind.BUFFER
    ]
    if not verdicts or any(v is None for v in verdicts):
        return None
    return tuple(dict.fromkeys(reason for verdict in verdicts for reason in verdict))


def name_fold(
    ep: ExportedProgram,
    node: torch.fx.Node,
    tensor: torch.Tensor,
    selection: Selection,
    register_like_source: bool,
) -> Materialization | Declined:
    expression, leaves = fold_expression(node, selection.sources)
    agreed = selection.custom[node]
    kind, target, persistent, blockers = InputKind.CONSTANT_TENSOR, None, True, None
    if register_like_source:
        kind, first = _registered_kind(leaves)
        digest = hashlib.sha256(expression.encode()).hexdigest()
        stem = f"{fold_root(first.fqn) if first else ''}_prop_{digest}"
        persistent = (first.persistent if first else None) if kind == InputKind.BUFFER else None
        blockers = carried_blockers(leaves) if kind == InputKind.BUFFER else None
        names = constant_names(stem, tensor)
        target = next((n for n in names if not _name_taken_by_other_data(ep, n, tensor)), None)
        if target is None:
            return Declined(f"{' and '.join(names)} already name constants with different data")
    return Materialization(
        node=node,
        kind=kind,
        target=target,
        persistent=persistent,
        custom=None if agreed is UNSET or not agreed else agreed,
        tensor=tensor,
        ops_folded=expression.count("\n") - len(leaves),
        buffer_fold_blockers=blockers,
    )


def name_folds(
    ep: ExportedProgram,
    selection: Selection,
    evaluation: Evaluation,
    *,
    register_like_source: bool,
    fold_buffers: bool,
) -> ConstantFolds | Declined:
    if not evaluation.folded:
        return Declined("no call_function node has only constant inputs")
    stored, erased = stored_and_erased(evaluation)
    taken = {storage_key(s.tensor) for s in selection.sources.values()} - {None}
    materialize = []
    for node in stored:
        tensor = fresh_constant(evaluation.values[node], taken)
        named = name_fold(ep, node, tensor, selection, register_like_source)
        if isinstance(named, Declined):
            record_declined(FOLD, node.name, named.reason)
            return named
        materialize.append(named)
    read = {p for n in evaluation.folded for p in n.all_input_nodes if p in selection.sources}
    return ConstantFolds(
        materialize=tuple(materialize),
        erase=tuple(n for n in evaluation.folded if n in erased),
        sources=tuple(n for n in ep.graph.nodes if n in read),
        fold_buffers=fold_buffers,
    )
