"""Constant propagation over a lifted ExportedProgram, ATen or Edge dialect.

    n = op(c_1, ..., c_k)        every c_i a parameter, a lifted constant, an
                                 unmutated buffer (when fold_buffers), a literal
                                 or another folded node
      -> v = op(value(c_1), ..., value(c_k)) computed once, here;
         n becomes a constant placeholder holding v when something outside the
         fold reads it, and is erased otherwise.

A non-tensor v (a Python float from `item`) is handed to the folded consumers and
never stored; its op stays in the graph only when an unfolded node reads it. A
multi-output op is never stored: its `getitem` projections are, one tensor each.

Naming. `register_like_source=False` (upstream-compatible): every fold is a
lifted constant named `_prop_tensor_constant{N}`. `True`: the fold is registered
like its sources (PARAMETER if any source is one, else BUFFER if any is, else a
lifted constant), keeps their `custom` meta, and is named
`<first source of that kind>_prop_<sha256 of the expression>`, so the same
expression over the same parameter gets the same name in every method.

Placement. A new placeholder goes after the last placeholder of its kind (else
after the kinds export puts before it); values are registered in graph order, so
callers binding by position read the right tensor. A constant returned as an
output goes through a clone in the graph's own dialect.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from executorch.exir import memory
from executorch.exir.dialects._ops import ops as exir_ops
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, OutputKind, TensorArgument

from etfold.decisions import Declined, record_applied, record_declined
from etfold.exir.passes.graph_walk import (
    PLACEHOLDER_RANK,
    ConstantSource,
    constant_sources,
    input_kinds,
    is_plain_tensor,
    op_namespace,
    op_qualified_name,
    underlying_op,
)

FOLD = "exir.constant_prop"
UPSTREAM_PREFIX = "_prop_tensor_constant"

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

_UNSET = object()  # "no source yet" in the custom-meta agreement


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


@dataclass(frozen=True)
class ConstantFolds:
    """The match: what becomes a constant, what is erased, what stays an op."""

    materialize: tuple[Materialization, ...]
    erase: tuple[torch.fx.Node, ...]  # folded nodes nothing outside the fold reads
    kept: tuple[torch.fx.Node, ...]  # non-tensor results read outside the fold
    sources: tuple[torch.fx.Node, ...]  # source placeholders the fold reads
    register_like_source: bool
    fold_buffers: bool


# --- preconditions, one predicate each -------------------------------------------------


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


def is_quant_primitive(node: torch.fx.Node) -> bool:
    return op_namespace(node.target) in QUANT_NAMESPACES


def is_custom_skip_target(node: torch.fx.Node, skip: Collection) -> bool:
    return node.target in skip or underlying_op(node.target) in skip


def _target_decline(node: torch.fx.Node, custom_skip_targets: Collection | None) -> str | None:
    if is_impure(node):
        return "impure op"
    if is_nondeterministic(node):
        return "nondeterministic op (nondeterministic_seeded)"
    if allocates_memory(node):
        return "memory allocation op"
    if custom_skip_targets is not None:
        if is_custom_skip_target(node, custom_skip_targets):
            return "in custom_skip_targets"
        return None
    if is_fill_factory(node):
        return "factory op that only fills a tensor"
    if is_quant_primitive(node):
        return "quantization primitive"
    return None


def _normalized_custom(node: torch.fx.Node):
    return node.meta.get("custom") or None


def sources_disagree_on_custom(node: torch.fx.Node, custom: Mapping[torch.fx.Node, Any]):
    """The `custom` meta all of `node`'s sources agree on, or a Declined."""
    agreed = _UNSET
    for producer in node.all_input_nodes:
        value = custom[producer]
        if value is _UNSET:
            continue
        if agreed is _UNSET:
            agreed = value
        elif value != agreed:
            return Declined(f"sources disagree on custom meta ({agreed!r} vs {value!r})")
    return agreed


def _is_foldable_value(value) -> bool:
    if is_plain_tensor(value):
        return True
    if isinstance(value, (bool, int, float)):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain_tensor(v) or v is None for v in value)
    return False


def evaluate(node: torch.fx.Node, values: Mapping[torch.fx.Node, Any]):
    """`node`'s value from its inputs' values, or a Declined."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: values[n])
    try:
        with torch.no_grad():
            result = node.target(*args, **kwargs)
    except Exception as error:  # fail closed: an op that cannot run here stays an op
        return Declined(f"evaluation raised {type(error).__name__}: {error}")
    if not _is_foldable_value(result):
        return Declined(f"result of type {type(result).__name__} cannot be held as a constant")
    return result


# --- the expression a fold is named for ------------------------------------------------


def _describe(value, index: Mapping[torch.fx.Node, int]) -> str:
    if isinstance(value, torch.fx.Node):
        return f"#{index[value]}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_describe(v, index) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return (
            "{"
            + ", ".join(f"{k!r}: {_describe(value[k], index)}" for k in sorted(value, key=repr))
            + "}"
        )
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return f"{type(value).__name__}:{value}"
    return repr(value)


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
        if source is not None:
            index[current] = len(lines)
            shape = "x".join(str(d) for d in source.tensor.shape)
            lines.append(
                f"#{len(lines)} = {source.kind.name.lower()} {source.fqn} {source.tensor.dtype}[{shape}]"
            )
            leaves.append(source)
            continue
        if not inputs_done:
            stack.append((current, True))
            stack.extend((p, False) for p in reversed(current.all_input_nodes) if p not in index)
            continue
        args = ", ".join(
            [_describe(a, index) for a in current.args]
            + [f"{k}={_describe(current.kwargs[k], index)}" for k in sorted(current.kwargs)]
        )
        index[current] = len(lines)
        lines.append(f"#{len(lines)} = {op_qualified_name(current.target)}({args})")
    lines.append(f"result #{index[node]}")
    return "\n".join(lines), leaves


def _registered_kind(leaves: Iterable[ConstantSource]) -> tuple[InputKind, ConstantSource | None]:
    leaves = list(leaves)
    for kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
        for leaf in leaves:
            if leaf.kind == kind:
                return kind, leaf
    return InputKind.CONSTANT_TENSOR, None


# --- match -----------------------------------------------------------------------------


def _allowlist(graph: torch.fx.Graph, nodes_to_fold) -> set[torch.fx.Node] | None:
    if nodes_to_fold is None:
        return None
    by_name = None
    allowed: set[torch.fx.Node] = set()
    for item in nodes_to_fold:
        if isinstance(item, str):
            by_name = by_name if by_name is not None else {n.name: n for n in graph.nodes}
            item = by_name.get(item)
        if isinstance(item, torch.fx.Node) and item.graph is graph:
            allowed.add(item)
    # a multi-output op folds with all its outputs
    for node in list(allowed):
        allowed.update(u for u in node.users if u.target is operator.getitem)
    return allowed


def _storage_key(tensor: torch.Tensor):
    return tensor.untyped_storage().data_ptr() if tensor.numel() else None


def _fresh_constant(value: torch.Tensor, taken_storages: set) -> torch.Tensor:
    """A detached, contiguous tensor that shares storage with no source or other fold."""
    shared = _storage_key(value) in taken_storages
    needs_copy = shared or value._is_view() or not value.is_contiguous()
    value = value.detach()
    if needs_copy:
        value = value.clone(memory_format=torch.contiguous_format)
    key = _storage_key(value)
    if key is not None:
        taken_storages.add(key)
    return value


def match_constant_folds(
    exported_program: ExportedProgram,
    custom_skip_targets: Collection | None = None,
    *,
    nodes_to_fold=None,
    fold_buffers: bool = True,
    register_like_source: bool = False,
) -> ConstantFolds | Declined:
    ep = exported_program
    sources, excluded = constant_sources(ep, fold_buffers=fold_buffers)
    allowed = _allowlist(ep.graph, nodes_to_fold)
    values: dict[torch.fx.Node, Any] = {n: s.tensor for n, s in sources.items()}
    custom: dict[torch.fx.Node, Any] = {n: _normalized_custom(n) for n in sources}
    folded: list[torch.fx.Node] = []
    outside_allowlist = 0

    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        producers = node.all_input_nodes
        if not all(p in values for p in producers):
            blocked = [p for p in producers if p in excluded]
            blocked_only_by_excluded = blocked and all(
                p in values or p in excluded for p in producers
            )
            if blocked_only_by_excluded and (allowed is None or node in allowed):
                record_declined(FOLD, node.name, f"reads {excluded[blocked[0]]}")
            continue
        if allowed is not None and node not in allowed:
            outside_allowlist += 1
            continue
        reason = _target_decline(node, custom_skip_targets)
        if reason is not None:
            record_declined(FOLD, node.name, reason)
            continue
        agreed = sources_disagree_on_custom(node, custom)
        if isinstance(agreed, Declined):
            record_declined(FOLD, node.name, agreed.reason)
            continue
        value = evaluate(node, values)
        if isinstance(value, Declined):
            record_declined(FOLD, node.name, value.reason)
            continue
        values[node] = value
        custom[node] = agreed
        folded.append(node)

    if outside_allowlist:
        record_declined(
            FOLD,
            "<program>",
            f"{outside_allowlist} constant-only node(s) outside nodes_to_fold stay ops",
        )
    if not folded:
        return Declined("no call_function node has only constant inputs")

    removed: set[torch.fx.Node] = set()  # erased or replaced by a placeholder
    kept: list[torch.fx.Node] = []
    to_materialize: list[torch.fx.Node] = []
    for node in reversed(folded):
        if all(u in removed for u in node.users):
            removed.add(node)
        elif is_plain_tensor(values[node]):
            removed.add(node)
            to_materialize.append(node)
        else:
            kept.append(node)
            record_declined(
                FOLD,
                node.name,
                f"non-tensor result ({type(values[node]).__name__}) read outside the fold stays an op",
            )
    to_materialize.reverse()
    kept.reverse()

    taken = {_storage_key(s.tensor) for s in sources.values()} - {None}
    materialize = []
    for node in to_materialize:
        tensor = _fresh_constant(values[node], taken)
        expression, leaves = fold_expression(node, sources)
        agreed = custom[node]
        if register_like_source:
            kind, first = _registered_kind(leaves)
            digest = hashlib.sha256(expression.encode()).hexdigest()
            target = f"{first.fqn if first else ''}_prop_{digest}"
            persistent = (first.persistent if first else None) if kind == InputKind.BUFFER else None
        else:
            kind, target, persistent = InputKind.CONSTANT_TENSOR, None, True
        ops_folded = expression.count("\n") - len(leaves)
        if register_like_source and _name_taken_by_other_data(ep, target, tensor):
            declined = Declined(f"{target} already names a constant with different data")
            record_declined(FOLD, node.name, declined.reason)
            return declined
        materialize.append(
            Materialization(
                node=node,
                kind=kind,
                target=target,
                persistent=persistent,
                custom=None if agreed is _UNSET else agreed,
                tensor=tensor,
                ops_folded=ops_folded,
            )
        )

    used_sources = {p for n in folded for p in n.all_input_nodes if p in sources}
    stored = set(to_materialize)
    return ConstantFolds(
        materialize=tuple(materialize),
        erase=tuple(n for n in folded if n in removed and n not in stored),
        kept=tuple(kept),
        sources=tuple(n for n in ep.graph.nodes if n in used_sources),
        register_like_source=register_like_source,
        fold_buffers=fold_buffers,
    )


def _name_taken_by_other_data(ep: ExportedProgram, target: str, tensor: torch.Tensor) -> bool:
    existing = ep.state_dict.get(target, ep.constants.get(target))
    if existing is None:
        return False
    same = (
        existing.shape == tensor.shape
        and existing.dtype == tensor.dtype
        and torch.equal(existing, tensor)
    )
    return not same


# --- rewrite ---------------------------------------------------------------------------


def _fake_mode(ep: ExportedProgram):
    mode = detect_fake_mode(tuple(n.meta["val"] for n in ep.graph.nodes if "val" in n.meta))
    return mode if mode is not None else FakeTensorMode()


def _upstream_name(ep: ExportedProgram) -> str:
    name = f"{UPSTREAM_PREFIX}{len(ep.constants)}"
    if name in ep.constants:
        taken = [
            int(k[len(UPSTREAM_PREFIX) :])
            for k in ep.constants
            if k.startswith(UPSTREAM_PREFIX) and k[len(UPSTREAM_PREFIX) :].isdigit()
        ]
        name = f"{UPSTREAM_PREFIX}{max(taken, default=-1) + 1}"
    return name


def _register(
    ep: ExportedProgram, kind: InputKind, target: str, persistent: bool | None, tensor: torch.Tensor
) -> None:
    if kind == InputKind.PARAMETER:
        ep.state_dict[target] = torch.nn.Parameter(tensor, requires_grad=False)
    elif kind == InputKind.BUFFER and persistent:
        ep.state_dict[target] = tensor
    else:
        ep.constants[target] = tensor


def _unregister(ep: ExportedProgram, spec: InputSpec) -> None:
    ep.state_dict.pop(spec.target, None)
    ep.constants.pop(spec.target, None)


def _insertion_point(ep: ExportedProgram, kinds: Mapping[str, InputKind], kind: InputKind):
    """After the last placeholder of `kind`, else after the last of an earlier kind."""
    rank = PLACEHOLDER_RANK[kind]
    same = earlier = None
    for node in ep.graph.find_nodes(op="placeholder"):
        node_kind = kinds.get(node.name, InputKind.USER_INPUT)
        if node_kind == kind:
            same = node
        elif PLACEHOLDER_RANK[node_kind] < rank:
            earlier = node
    anchor = same or earlier
    if anchor is not None:
        return ep.graph.inserting_after(anchor)
    return ep.graph.inserting_before(next(iter(ep.graph.nodes)))


def _placeholder_name(kind: InputKind, target: str) -> str:
    prefix = {InputKind.PARAMETER: "p_", InputKind.BUFFER: "b_", InputKind.CONSTANT_TENSOR: "c_"}[
        kind
    ]
    return prefix + target.replace(".", "_")


def _uses_dim_order(ep: ExportedProgram) -> bool:
    """Whether the Edge graph speaks dim order: its own copies say so first, the verifier's config second."""
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        if op_namespace(node.target) == "dim_order_ops":
            return True
        if op_qualified_name(node.target) in ("aten.clone.default", "aten._to_copy.default"):
            return False
    try:
        return bool(ep.verifiers[0]().use_dim_order)
    except Exception:
        return True  # EdgeCompileConfig's default


def _clone_target(ep: ExportedProgram):
    """A clone in the graph's own dialect."""
    if ep.dialect != "EDGE":
        return torch.ops.aten.clone.default
    if _uses_dim_order(ep):
        return exir_ops.edge.dim_order_ops._clone_dim_order.default
    return exir_ops.edge.aten.clone.default


def _clone_constant_outputs(ep: ExportedProgram, fold_buffers: bool) -> None:
    """Outputs are rebound to surviving nodes; a constant returned as an output goes through a clone."""
    constants, _ = constant_sources(ep, fold_buffers=fold_buffers)
    output = ep.graph.output_node()
    returned = list(output.args[0])
    specs = ep.graph_signature.output_specs
    clone = None
    for position, (value, spec) in enumerate(zip(returned, specs, strict=True)):
        if not isinstance(value, torch.fx.Node):
            continue
        if spec.kind == OutputKind.USER_OUTPUT and value in constants:
            clone = clone or _clone_target(ep)
            with ep.graph.inserting_before(output):
                copy = ep.graph.call_function(clone, (value,))
            copy.meta["val"] = value.meta["val"]
            returned[position] = value = copy
        if isinstance(spec.arg, TensorArgument) and spec.arg.name != value.name:
            spec.arg = TensorArgument(name=value.name)
    output.args = (type(output.args[0])(returned),)


def rewrite_constant_folds(
    exported_program: ExportedProgram, folds: ConstantFolds
) -> ExportedProgram:
    ep = exported_program
    graph = ep.graph
    signature = ep.graph_signature
    specs: dict[str, InputSpec] = {
        s.arg.name: s for s in signature.input_specs if hasattr(s.arg, "name")
    }
    kinds = input_kinds(ep)
    by_target = {
        s.target: n
        for n in graph.find_nodes(op="placeholder")
        if (s := specs.get(n.name)) and s.target
    }
    fake_mode = _fake_mode(ep)

    for fold in folds.materialize:
        target = fold.target if fold.target is not None else _upstream_name(ep)
        placeholder = by_target.get(target)
        if placeholder is None:
            _register(ep, fold.kind, target, fold.persistent, fold.tensor)
            name = target if fold.target is None else _placeholder_name(fold.kind, target)
            with _insertion_point(ep, kinds, fold.kind):
                placeholder = graph.create_node("placeholder", name, name=name)
            placeholder.target = placeholder.name  # the graph namespace may have renamed it
            if fold.target is None:
                placeholder.meta.update(fold.node.meta)
            elif fold.custom is not None:
                placeholder.meta["custom"] = dict(fold.custom)
            placeholder.meta["val"] = fake_mode.from_tensor(fold.tensor, static_shapes=True)
            specs[placeholder.name] = InputSpec(
                kind=fold.kind,
                arg=TensorArgument(name=placeholder.name),
                target=target,
                persistent=fold.persistent,
            )
            kinds[placeholder.name] = fold.kind
            by_target[target] = placeholder
        fold.node.replace_all_uses_with(placeholder)
        record_applied(
            FOLD, fold.node.name, f"{fold.ops_folded} op(s) -> {fold.kind.name.lower()} {target}"
        )

    gone = {fold.node for fold in folds.materialize} | set(folds.erase)
    for node in reversed([n for n in graph.nodes if n in gone]):
        assert not node.users, f"{node.name} still has users after folding"
        graph.erase_node(node)
    for source in folds.sources:
        if not source.users:
            _unregister(ep, specs.pop(source.name))
            graph.erase_node(source)

    order = [n.name for n in graph.find_nodes(op="placeholder")]
    signature.input_specs = [specs[name] for name in order]
    assert [s.arg.name for s in signature.input_specs] == order, (
        "signature order differs from placeholder order"
    )

    _clone_constant_outputs(ep, folds.fold_buffers)
    ep.graph_module.recompile()
    return ep


def constant_prop_pass(
    exported_program: ExportedProgram,
    custom_skip_targets: Collection | None = None,
    *,
    nodes_to_fold=None,
    fold_buffers: bool = True,
    register_like_source: bool = False,
) -> ExportedProgram:
    """Fold every allowed call_function node whose inputs are all constants.

    custom_skip_targets: ops never folded; replaces the default set (fill-only
        factories and quantization primitives). Impure, nondeterministic and
        allocation ops are never folded.
    nodes_to_fold: an allowlist of nodes (or node names); nothing outside it folds.
    fold_buffers: whether unmutated buffers count as constants.
    register_like_source: see the module docstring.

    Mutates and returns `exported_program`; returns it untouched when nothing folds.
    """
    folds = match_constant_folds(
        exported_program,
        custom_skip_targets,
        nodes_to_fold=nodes_to_fold,
        fold_buffers=fold_buffers,
        register_like_source=register_like_source,
    )
    if isinstance(folds, Declined):
        return exported_program
    return rewrite_constant_folds(exported_program, folds)
