# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Graph walks over lifted ExportedPrograms, shared by etfold's exir passes.

Every walk here is iterative (explicit stacks), so graph depth is never bounded
by Python's recursion limit.
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from executorch.exir.dialects.edge._ops import EdgeOpOverload
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from etfold.decisions import Declined

# Placeholder kinds in the order torch.export lays them out.
PLACEHOLDER_RANK = {
    InputKind.TOKEN: 0,
    InputKind.PARAMETER: 1,
    InputKind.BUFFER: 2,
    InputKind.CONSTANT_TENSOR: 3,
    InputKind.CUSTOM_OBJ: 3,
    InputKind.USER_INPUT: 4,
}


@dataclass(frozen=True)
class ConstantSource:
    """A placeholder whose value is known before the program runs."""

    node: torch.fx.Node
    kind: InputKind
    fqn: str
    persistent: bool | None
    tensor: torch.Tensor


def underlying_op(target):
    """The ATen overload behind an Edge op; any other target unchanged."""
    return target._op if isinstance(target, EdgeOpOverload) else target


def op_qualified_name(target) -> str:
    """`aten.t.default`, `quantized_decomposed.quantize_per_tensor.default`, `_operator.getitem`."""
    op = underlying_op(target)
    if isinstance(op, torch._ops.OpOverload):
        return str(op)
    module = getattr(op, "__module__", None) or type(op).__module__
    name = getattr(op, "__qualname__", None) or getattr(op, "__name__", None) or repr(op)
    return f"{module}.{name}"


def op_namespace(target) -> str | None:
    op = underlying_op(target)
    return op.namespace if isinstance(op, torch._ops.OpOverload) else None


def placeholders(ep: ExportedProgram) -> list[torch.fx.Node]:
    return list(ep.graph.find_nodes(op="placeholder"))


# the placeholder kinds whose value the program holds (a state placeholder); the rest are
# user inputs, tokens and script objects
STATE_KINDS = frozenset({InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR})


def input_kinds(ep: ExportedProgram) -> dict[str, InputKind]:
    """Placeholder name -> what kind of input it is: the one answer every etfold walk asks."""
    return {
        spec.arg.name: spec.kind
        for spec in ep.graph_signature.input_specs
        if hasattr(spec.arg, "name")
    }


def state_placeholders(
    ep: ExportedProgram, kinds: frozenset[InputKind] = STATE_KINDS
) -> dict[str, torch.fx.Node]:
    """FQN -> placeholder, for the inputs of `kinds` (default: parameters, buffers, constants)."""
    by_name = {n.name: n for n in ep.graph.find_nodes(op="placeholder")}
    return {
        spec.target: by_name[spec.arg.name]
        for spec in ep.graph_signature.input_specs
        if spec.kind in kinds and spec.target is not None and spec.arg.name in by_name
    }


def stored_value(ep: ExportedProgram, kind: InputKind, fqn: str, persistent: bool | None):
    """The tensor behind a parameter, buffer or lifted constant, wherever export stored it."""
    if kind == InputKind.PARAMETER:
        return ep.state_dict.get(fqn)
    if kind == InputKind.BUFFER and persistent is not False:
        return ep.state_dict.get(fqn, ep.constants.get(fqn))
    return ep.constants.get(fqn)


def _reachable(node: torch.fx.Node, inputs) -> set[torch.fx.Node]:
    """`node` and every node `inputs` leads to from it, transitively."""
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(inputs(current))
    return seen


def ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    """`node` and every node it reads, directly or through others."""
    return _reachable(node, lambda current: current.all_input_nodes)


# fills of their first operand's shape (a `new_*` fill is only typed like it)
FILLS_SHAPED_LIKE_OPERAND = frozenset(
    {
        torch.ops.aten.zeros_like.default,
        torch.ops.aten.ones_like.default,
        torch.ops.aten.full_like.default,
    }
)
# ops that read their first operand for its shape, dtype and device only, never its
# values: a size read, and the fills shaped (or typed) like it
SHAPE_ONLY_READERS = FILLS_SHAPED_LIKE_OPERAND | frozenset(
    {
        torch.ops.aten.sym_size.int,
        torch.ops.aten.new_zeros.default,
        torch.ops.aten.new_ones.default,
        torch.ops.aten.new_full.default,
    }
)


def value_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes whose values `node` reads: its inputs, less the first operand of an op
    that reads only that operand's shape (`SHAPE_ONLY_READERS`)."""
    if node.target not in SHAPE_ONLY_READERS:
        return node.all_input_nodes
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args[1:], node.kwargs), found.append)
    return list(dict.fromkeys(found))


def value_ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    """`node` and every node whose values it is computed from (`value_inputs`): a size
    read or a fill shaped like an operand is in, that operand is not."""
    return _reachable(node, value_inputs)


def drop_unread(nodes: list[torch.fx.Node]) -> None:
    """Each pure op among `nodes`, and those it reads in turn, that nothing reads now
    but export's checks of its metadata (`_assert_tensor_metadata`, which go with it:
    they check what the graph already states, and no one reads the value)."""
    stack, erased = list(nodes), set()
    while stack:
        node = stack.pop()
        if node in erased or node.op != "call_function" or node.is_impure():
            continue
        if any(
            user.target is not torch.ops.aten._assert_tensor_metadata.default for user in node.users
        ):
            continue
        for check in list(node.users):
            node.graph.erase_node(check)
        stack.extend(node.all_input_nodes)
        node.graph.erase_node(node)
        erased.add(node)


_aten = torch.ops.aten
# ops whose result holds the elements of their first argument, rearranged (or the same):
# views and layout copies, in the ATen and Edge dialects alike
RELAYOUT_OPS = frozenset(
    {
        _aten.t.default,
        _aten.t_copy.default,
        _aten.transpose.int,
        _aten.transpose_copy.int,
        _aten.permute.default,
        _aten.permute_copy.default,
        _aten.numpy_T.default,
        _aten.view.default,
        _aten.view_copy.default,
        _aten.reshape.default,
        _aten._unsafe_view.default,
        _aten.alias.default,
        _aten.alias_copy.default,
        _aten.detach.default,
        _aten.clone.default,
        _aten.lift_fresh_copy.default,
        _aten.unsqueeze.default,
        _aten.unsqueeze_copy.default,
        _aten.squeeze.dim,
        _aten.squeeze.dims,
        _aten.squeeze.default,
        _aten.squeeze_copy.dim,
        _aten.squeeze_copy.dims,
        _aten.flatten.using_ints,
    }
)
# converts: a re-layout only where they keep the dtype
_CONVERTS = frozenset({_aten.to.dtype, _aten.to.dtype_layout, _aten._to_copy.default})


def is_relayout(node: torch.fx.Node) -> bool:
    """`node` only re-lays out its first argument's elements: a view, a layout copy, or a
    convert to the dtype it already has. The one answer to "does this op compute"."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    op = underlying_op(node.target)
    if op in RELAYOUT_OPS:
        return True
    before, after = node.args[0].meta.get("val"), node.meta.get("val")
    return (
        op in _CONVERTS
        and isinstance(before, torch.Tensor)
        and isinstance(after, torch.Tensor)
        and before.dtype == after.dtype
        and before.device == after.device
    )


def relayout_root(node: object) -> tuple[object, tuple[torch.fx.Node, ...]]:
    """What `node`'s elements come from through re-layouts alone, and those re-layouts,
    root first (none: `node` itself is the root)."""
    chain = []
    while isinstance(node, torch.fx.Node) and is_relayout(node):
        chain.append(node)
        node = node.args[0]
    return node, tuple(reversed(chain))


def is_plain_tensor(value) -> bool:
    return type(value) in (torch.Tensor, torch.nn.Parameter)


def written_arguments(node: torch.fx.Node) -> Iterator[torch.fx.Node]:
    """Nodes `node` may write in place, per its schema: the one answer to "does this
    op write that value" for every etfold walk."""
    schema = getattr(underlying_op(node.target), "_schema", None)
    if schema is None or not schema.is_mutable:
        return
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if position < len(node.args):
            passed = node.args[position]
        else:
            passed = node.kwargs.get(argument.name)
        yield from _nodes_in(passed)


def _nodes_in(value) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(value, found.append)
    return found


# higher-order regions whose body is plain code -> the position of the body argument
_REGION_BODY_AT = {
    torch.ops.higher_order.wrap_with_autocast: 4,
    torch.ops.higher_order.wrap_with_set_grad_enabled: 1,
}


_OPAQUE_CALLS = (torch._ops.HigherOrderOperator, torch._ops.OpOverloadPacket)


def _region_roles(user: torch.fx.Node, value: torch.fx.Node) -> set[str]:
    """A region writes `value` when its body writes the operand; its results may alias it."""
    at = _REGION_BODY_AT[user.target]
    body = getattr(user.graph.owning_module, getattr(user.args[at], "target", ""), None)
    if not isinstance(body, torch.fx.GraphModule):
        return {"unknown"}
    operands = zip(user.args[at + 1 :], body.graph.find_nodes(op="placeholder"), strict=False)
    inner = [placeholder for operand, placeholder in operands if operand is value]
    return {"write", "alias"} if any(map(in_place_writers, inner)) else {"alias"}


def _argument_roles(user: torch.fx.Node, value: torch.fx.Node) -> set[str]:
    """How `user` treats `value`: "write", "alias" (a view), "read" or "unknown"."""
    target = user.target
    if target is operator.getitem:
        return {"alias"}
    if target in _REGION_BODY_AT:
        return _region_roles(user, value)
    op = underlying_op(target)
    if not isinstance(op, torch._ops.OpOverload):
        # a region or module call may write what it is passed; a plain Python
        # callable (a builtin, a sym op) never writes a tensor in an exported graph
        opaque = user.op != "call_function" or isinstance(op, _OPAQUE_CALLS)
        return {"unknown"} if opaque else {"read"}
    schema = op._schema
    written = set(written_arguments(user))
    roles: set[str] = set()
    bound = list(zip(schema.arguments, user.args, strict=False))
    by_name = {a.name: a for a in schema.arguments}
    bound += [(by_name[k], v) for k, v in user.kwargs.items() if k in by_name]
    for argument, passed in bound:
        if passed is value:
            nested = False
        elif isinstance(passed, (list, tuple)) and any(p is value for p in passed):
            nested = True
        else:
            continue
        if value in written:
            roles.add("write")
        elif nested and schema.is_mutable:
            # element alias sets of a Tensor[] argument are not exposed; assume the worst
            roles.add("write")
        elif argument.alias_info is not None:
            roles.add("alias")
        else:
            roles.add("read")
    return roles or {"unknown"}


def in_place_writers(start: torch.fx.Node) -> list[torch.fx.Node]:
    """Ops that may write `start` or a view of it: an in-place op (per its schema), a
    region whose body writes it, or an op whose schema is unknown. The one answer to
    "who writes this value in place" for every etfold walk."""
    writers: list[torch.fx.Node] = []
    stack, seen = [start], {start}
    while stack:
        value = stack.pop()
        for user in value.users:
            if user.op == "output":
                continue
            roles = _argument_roles(user, value)
            if ("write" in roles or "unknown" in roles) and user not in writers:
                writers.append(user)
            if "alias" in roles and user not in seen:
                seen.add(user)
                stack.append(user)
    return writers


# outputs whose value a call leaves in a parameter, buffer or user input
WRITE_BACK_OUTPUT_KINDS = frozenset(
    {OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION, OutputKind.USER_INPUT_MUTATION}
)
FUNCTIONALIZED = "a functionalized mutation"


@dataclass(frozen=True)
class StateWrite:
    """A write that persists past the call: after it, `destination` holds `value`'s result.

    `destination` is a placeholder (parameter, buffer, user input) or a `get_attr`;
    `value` is the output of a functionalized mutation, or the op writing in place
    (whose result aliases what it wrote); `how` names that op, or FUNCTIONALIZED."""

    destination: torch.fx.Node
    value: torch.fx.Node
    how: str


def _functionalized_writes(ep: ExportedProgram) -> Iterator[StateWrite]:
    by_name = {n.name: n for n in ep.graph.find_nodes(op="placeholder")}
    input_of = {s.target: s.arg.name for s in ep.graph_signature.input_specs if s.target}
    outputs = ep.graph.output_node().args[0]
    for spec, value in zip(ep.graph_signature.output_specs, outputs, strict=False):
        if spec.kind not in WRITE_BACK_OUTPUT_KINDS or not isinstance(value, torch.fx.Node):
            continue
        destination = by_name.get(input_of.get(spec.target, spec.target))
        if destination is not None:
            yield StateWrite(destination, value, FUNCTIONALIZED)


def state_writes(
    graph_module: torch.fx.GraphModule, program: ExportedProgram | None = None
) -> list[StateWrite]:
    """Every write into a parameter, buffer, user input or attribute that persists past a
    call, in place or functionalized alike: the one answer to "which ops write state,
    and which outputs are write-backs". The signature's write-back outputs count when
    `program` is the ExportedProgram owning `graph_module`."""
    writes = []
    if program is not None and program.graph_module is graph_module:
        writes += _functionalized_writes(program)
    for root in graph_module.graph.nodes:
        if root.op not in ("placeholder", "get_attr"):
            continue
        writes += [
            StateWrite(root, writer, op_qualified_name(writer.target))
            for writer in in_place_writers(root)
        ]
    return writes


def known_placeholder(
    ep: ExportedProgram, node: torch.fx.Node, *, facts: StateFacts | None = None
) -> ConstantSource | Declined | None:
    """Whether a placeholder's value is known before the program runs: the one answer.

    Known: parameters, buffers and lifted tensor constants the program never writes.
    Not known (Declined, with why): anything written in place or through a write-back
    output (`state_writes`), a parameter that receives a gradient, a non-plain tensor.
    None: not a parameter, buffer or constant (a user input). Whether a fold may read a
    known value is policy (buffers, other methods): `constant_prop.verdicts`.
    `facts` is `state_facts(ep)`, when the caller asks about many placeholders.
    """
    facts = facts or state_facts(ep)
    spec = facts.specs.get(node.name)
    if spec is None or spec.kind not in STATE_KINDS:
        return None
    if node in facts.writes:
        ops = ", ".join(sorted(set(facts.writes[node])))
        return Declined(f"`{spec.target}` is written in this method ({ops})")
    if spec.target in facts.trained:
        return Declined(f"`{spec.target}` receives a gradient (trained by the program)")
    value = stored_value(ep, spec.kind, spec.target, spec.persistent)
    if not is_plain_tensor(value):
        return Declined(f"`{spec.target}` is not a plain tensor ({type(value).__name__})")
    return ConstantSource(node, spec.kind, spec.target, spec.persistent, value)


@dataclass(frozen=True)
class StateFacts:
    """What `known_placeholder` reads from the whole program, gathered once."""

    specs: dict  # placeholder name -> its InputSpec
    writes: dict[torch.fx.Node, list[str]]  # placeholder -> how the program writes it
    trained: frozenset[str]  # parameters that receive a gradient


def state_facts(ep: ExportedProgram) -> StateFacts:
    writes: dict[torch.fx.Node, list[str]] = {}
    for write in state_writes(ep.graph_module, ep):
        if write.destination.op == "placeholder":
            writes.setdefault(write.destination, []).append(write.how)
    signature = ep.graph_signature
    return StateFacts(
        specs={s.arg.name: s for s in signature.input_specs if hasattr(s.arg, "name")},
        writes=writes,
        trained=frozenset(
            s.target for s in signature.output_specs if s.kind == OutputKind.GRADIENT_TO_PARAMETER
        ),
    )


CHANNELS_LAST_DIM_ORDER = (0, 2, 3, 1)


def is_channels_last(value) -> bool:
    """A 4-D tensor whose dim order is channels-last.

    Decided by dim order, not by which layouts the strides satisfy: a size-1 channel
    or spatial dim makes a tensor contiguous in both, yet ExecuTorch carries the dim
    order with it, and XNNPACK tags a channels-last copy NHWC whatever its sizes."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 4
        and tuple(value.dim_order()) == CHANNELS_LAST_DIM_ORDER
    )


def call_with_value(
    graph: torch.fx.Graph,
    target,
    args: tuple,
    value: object,
    meta: dict | None = None,
    kwargs: dict | None = None,
) -> torch.fx.Node:
    """`target(*args, **kwargs)` at the graph's insertion point, its fake value `value`:
    the node gets a copy of `meta` (a node's metadata it stands in for) with that value,
    or, with no `meta`, only the value."""
    node = graph.call_function(target, args, kwargs or {})
    if meta is None:
        node.meta["val"] = value
    else:
        node.meta = {**meta, "val": value}
    return node


def insert_to_copy(graph: torch.fx.Graph, value: torch.fx.Node, **kwargs) -> torch.fx.Node:
    """`aten._to_copy(value, **kwargs)` at the graph's insertion point, with its `val`."""
    copied = graph.call_function(torch.ops.aten._to_copy.default, (value,), kwargs)
    # graph_walk sits below node_shapes (which imports it): it reads the fake value itself
    copied.meta["val"] = torch.ops.aten._to_copy.default(value.meta["val"], **kwargs)
    return copied


def convert_every_use(graph: torch.fx.Graph, node: torch.fx.Node, **kwargs) -> torch.fx.Node:
    """Put `aten._to_copy(node, **kwargs)` right after `node` and make every other user of
    `node` read that copy instead; returns the copy."""
    with graph.inserting_after(node):
        converted = insert_to_copy(graph, node, **kwargs)
    node.replace_all_uses_with(converted, delete_user_cb=lambda user: user is not converted)
    return converted


def tensor_digest(tensor: torch.Tensor, length: int | None = None) -> str:
    """sha256 of a tensor's dtype, shape and bytes (its first `length` hex digits): equal
    digests mean equal tensors, so it names constants by content and finds duplicates."""
    data = tensor.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{data.dtype}:{tuple(data.shape)}:".encode())
    digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:length]


def symbolic_axes(value: object) -> tuple[int, ...]:
    """The axes of a (fake) tensor whose size is symbolic (a `torch.export.Dim` or an
    expression of one): the one answer to "is this dim dynamic". () for anything else."""
    if not isinstance(value, torch.Tensor):
        return ()
    return tuple(i for i, size in enumerate(value.shape) if type(size) is not int)


def sizes_known_equal(a: object, b: object) -> bool:
    """Two sizes (ints or SymInts) are equal for every value the export's bounds allow."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


# at most this many sizes are tried one by one (torch evaluates ~25,000 a second)
EVERY_SIZE_LIMIT = 40_000


def order_at_every_size(a: object, b: object, limit: int = EVERY_SIZE_LIMIT) -> str | None:
    """ "<=" or ">=" when `a` <= `b` (or `a` >= `b`) for every size the export's bounds
    allow, two sizes (ints or SymInts); None when neither holds, or when torch cannot
    prove either and the bounds hold more than `limit` sizes to try one by one."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if statically_known_true(a <= b):
        return "<="
    if statically_known_true(a >= b):
        return ">="
    differences = _at_every_size(a - b, limit)
    if differences is None:
        return None
    if max(differences) <= 0:
        return "<="
    return ">=" if min(differences) >= 0 else None


def _at_every_size(size: object, limit: int) -> set[int] | None:
    """The values `size` takes over every combination of its symbols' bounds, evaluated
    as torch evaluates size expressions; None past `limit` combinations."""
    import itertools

    from torch.utils._sympy.interp import sympy_interp
    from torch.utils._sympy.reference import PythonReferenceAnalysis

    if type(size) is int:
        return {size}
    expr, shape_env = size.node.expr, size.node.shape_env
    symbols = sorted(expr.free_symbols, key=str)
    ranges = [shape_env.bound_sympy(symbol) for symbol in symbols]
    if not all(r.lower.is_finite and r.upper.is_finite for r in ranges):
        return None
    spans = [range(int(r.lower), int(r.upper) + 1) for r in ranges]
    if math.prod(len(span) for span in spans) > limit:
        return None
    return {
        int(sympy_interp(PythonReferenceAnalysis, dict(zip(symbols, values, strict=True)), expr))
        for values in itertools.product(*spans)
    }


def size_bounds(size: object) -> tuple[int, int | float]:
    """The (min, max) a size takes within the export's bounds (an int: itself twice)."""
    if type(size) is int:
        return size, size
    node = size.node
    bound = node.shape_env.bound_sympy(node.expr)
    upper = bound.upper
    return int(bound.lower), int(upper) if upper.is_finite else float("inf")


def describe_axes(value: torch.Tensor, axes) -> str:
    """`dim 1 (s0 in 4..64)`-style names of `axes`, for a decline's reason."""
    parts = []
    for axis in axes:
        size = value.shape[axis]
        low, high = size_bounds(size)
        parts.append(f"dim {axis} ({size} in {low}..{high})")
    return ", ".join(parts)


def known_contiguous(value: torch.Tensor) -> bool:
    """The (fake) tensor is contiguous for every size the export's bounds allow; a
    symbolic layout that cannot be decided counts as not contiguous."""
    from torch._prims_common import is_contiguous_or_false

    return bool(is_contiguous_or_false(value))


def _taken_names(
    graph_module: torch.fx.GraphModule, exported_program: ExportedProgram | None
) -> set[str]:
    taken = {n.name for n in graph_module.graph.nodes}
    taken |= {
        str(n.target) for n in graph_module.graph.nodes if n.op in ("get_attr", "placeholder")
    }
    taken |= {
        n.meta["requested_name"] for n in graph_module.graph.nodes if "requested_name" in n.meta
    }
    taken |= {name for name, _ in graph_module.named_parameters()} | {
        name for name, _ in graph_module.named_buffers()
    }
    taken |= set(dir(graph_module))
    if exported_program is not None:
        taken |= set(exported_program.state_dict) | set(exported_program.constants)
    return taken


NAME_DIGEST_LENGTH = 10  # hex digits of `tensor_digest` in a constant's name


def constant_names(stem: str, value: torch.Tensor, reader: str | None = None) -> list[str]:
    """The names a new constant holding `value` may take, in the order they are tried:
    `stem`, the caller's source and expression (`conv_weight_mul_<digest of s>`); then
    `<stem>_<digest of value>`; then, with a `reader`, `<stem>_<digest>_for_<reader>`."""
    digested = f"{stem}_{tensor_digest(value, NAME_DIGEST_LENGTH)}"
    return [stem, digested, *([f"{digested}_for_{reader}"] if reader else [])]


def fresh_constant_name(
    graph_module: torch.fx.GraphModule,
    exported_program: ExportedProgram | None,
    stem: str,
    value: torch.Tensor,
    reader: str | None = None,
) -> str:
    """The name of a new constant holding `value`: the one rule every etfold pass names
    its constants by, deterministic and never a counter.

    The first of `constant_names(stem, value, reader)`, dots as underscores, that no
    node, attribute or program entry holds yet. So a constant is named from its
    source and expression; when that name is held (by another value, or by this value
    for another reader) the value's digest makes it fresh, and when that is held too
    (the same value from the same expression, already made for another reader) the
    reader's name does. A new constant never shares a name, or a tensor, with one
    another node reads; sharing an equal constant instead is the caller's choice
    (`constant_holding`). Running out is a bug, not a fold decision.
    """
    taken = _taken_names(graph_module, exported_program)
    names = [name.replace(".", "_") for name in constant_names(stem, value, reader)]
    fresh = next((name for name in names if name not in taken), None)
    if fresh is None:
        raise RuntimeError(f"no fresh constant name among {names}")
    return fresh


def equal_tensors(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and values."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def constant_holding(
    ep: ExportedProgram, target: str, tensor: torch.Tensor
) -> torch.fx.Node | None:
    """The placeholder of the program's parameter, buffer or constant `target` when it
    holds exactly `tensor` (`equal_tensors`); else None. What a pass that shares an
    equal constant, rather than making a fresh one, asks."""
    by_name = {n.name: n for n in placeholders(ep)}
    for spec in ep.graph_signature.input_specs:
        if spec.kind not in STATE_KINDS or spec.target != target:
            continue
        held = stored_value(ep, spec.kind, spec.target, spec.persistent)
        if isinstance(held, torch.Tensor) and equal_tensors(held, tensor):
            return by_name.get(spec.arg.name)
    return None


def remove_unread_placeholder(ep: ExportedProgram, node: torch.fx.Node) -> None:
    """Erase a parameter, buffer or lifted constant that nothing reads any more: its
    placeholder, its input spec and its stored value."""
    if node.users:
        raise ValueError(f"{node.name} is still read by {', '.join(u.name for u in node.users)}")
    specs = ep.graph_signature.input_specs
    (spec,) = [s for s in specs if getattr(s.arg, "name", None) == node.name]
    if spec.kind not in STATE_KINDS:
        raise ValueError(f"{node.name} is a {spec.kind.name.lower()}, not a constant")
    specs.remove(spec)
    ep.state_dict.pop(spec.target, None)
    ep.constants.pop(spec.target, None)
    ep.graph.erase_node(node)


def add_lifted_constant(
    ep: ExportedProgram, stem: str, tensor: torch.Tensor, reader: str | None = None
) -> torch.fx.Node:
    """A new lifted tensor constant holding `tensor`, named by `fresh_constant_name(stem,
    tensor, reader)`: its placeholder after the program's parameters, buffers and
    constants (in torch.export's order), its input spec, its entry in `ep.constants`."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.export.graph_signature import InputSpec, TensorArgument

    target = fresh_constant_name(ep.graph_module, ep, stem, tensor, reader)
    kinds = input_kinds(ep)
    holders = placeholders(ep)
    rank = PLACEHOLDER_RANK[InputKind.CONSTANT_TENSOR]
    position = sum(
        PLACEHOLDER_RANK[kinds.get(n.name, InputKind.USER_INPUT)] <= rank for n in holders
    )
    if position < len(holders):
        inserting = ep.graph.inserting_before(holders[position])
    else:
        inserting = (
            ep.graph.inserting_after(holders[-1]) if holders else ep.graph.inserting_before()
        )
    with inserting:
        node = ep.graph.placeholder(target.replace(".", "_"))
    node.target = node.name
    # graph_walk sits below node_shapes (which imports it): it reads the fake values itself
    fake_mode = detect_fake_mode([n.meta.get("val") for n in holders]) or FakeTensorMode()
    node.meta["val"] = fake_mode.from_tensor(tensor, static_shapes=True)
    ep.constants[target] = tensor
    spec = InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(name=node.name), target)
    ep.graph_signature.input_specs.insert(position, spec)
    return node
