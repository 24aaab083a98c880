# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Which buffers a fold may read as constants, decided over every method at once.

A pre-decomposition hook sees one method. A buffer that method only reads may
still be written by another method, or read by several (folding it in one
method would duplicate it). `mark_buffer_fold_blockers` runs in
`etfold.exir.to_edge_transform_and_lower`, which sees every method, and gives
every buffer placeholder a verdict in `meta[BUFFER_FOLD_BLOCKERS]`: a tuple of
reasons, empty when no method writes the buffer and at most one method reads it.

A buffer without the key was never judged (the program came through upstream's
entry point), so a fold must treat it as possibly written.

Programs are not functionalized yet when this runs, so a write is an in-place
op on the buffer or on a view of it, a custom op whose schema marks that
argument mutable, or an op whose schema is unknown; a functionalized program's
BUFFER_MUTATION outputs count as writes too. An autocast or grad-mode region
writes a buffer when its body does (its results are taken as views of it).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Mapping

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from etfold.exir.passes.graph_walk import op_qualified_name, written_arguments

BUFFER_FOLD_BLOCKERS = "etfold_buffer_fold_blockers"


# higher-order regions whose body is plain code -> the position of the body argument
_REGION_BODY_AT = {
    torch.ops.higher_order.wrap_with_autocast: 4,
    torch.ops.higher_order.wrap_with_set_grad_enabled: 1,
}


def _region_roles(user: torch.fx.Node, value: torch.fx.Node) -> set[str]:
    """A region writes `value` when its body writes the operand; its results may alias it."""
    at = _REGION_BODY_AT[user.target]
    body = getattr(user.graph.owning_module, getattr(user.args[at], "target", ""), None)
    if not isinstance(body, torch.fx.GraphModule):
        return {"unknown"}
    operands = zip(user.args[at + 1 :], body.graph.find_nodes(op="placeholder"), strict=False)
    inner = [placeholder for operand, placeholder in operands if operand is value]
    return {"write", "alias"} if any(map(in_place_writes, inner)) else {"alias"}


def _argument_roles(user: torch.fx.Node, value: torch.fx.Node) -> set[str]:
    """How `user` treats `value`: "write", "alias" (a view), "read" or "unknown"."""
    target = user.target
    if target is operator.getitem:
        return {"alias"}
    if target in _REGION_BODY_AT:
        return _region_roles(user, value)
    if not isinstance(target, torch._ops.OpOverload):
        return {"unknown"}
    schema = target._schema
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
        alias = argument.alias_info
        if value in written:
            roles.add("write")
        elif nested and schema.is_mutable:
            # element alias sets of a Tensor[] argument are not exposed; assume the worst
            roles.add("write")
        elif alias is not None:
            roles.add("alias")
        else:
            roles.add("read")
    return roles or {"unknown"}


def in_place_writes(start: torch.fx.Node) -> list[str]:
    """Ops that may write `start` or a view of it, as `aten.copy_.default` names."""
    writes: list[str] = []
    stack, seen = [start], {start}
    while stack:
        value = stack.pop()
        for user in value.users:
            if user.op == "output":
                continue
            roles = _argument_roles(user, value)
            if "write" in roles or "unknown" in roles:
                writes.append(op_qualified_name(user.target))
            if "alias" in roles and user not in seen:
                seen.add(user)
                stack.append(user)
    return writes


def buffer_placeholders(program: ExportedProgram) -> dict[str, torch.fx.Node]:
    """Buffer FQN -> its placeholder."""
    by_name = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    return {
        spec.target: by_name[spec.arg.name]
        for spec in program.graph_signature.input_specs
        if spec.kind == InputKind.BUFFER and spec.arg.name in by_name
    }


_STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
_MUTATION_KINDS = (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION)


def state_writes(program: ExportedProgram) -> dict[str, list[str]]:
    """Parameter/buffer/constant FQN -> what in this program may write it (empty lists omitted)."""
    writes: dict[str, list[str]] = defaultdict(list)
    for spec in program.graph_signature.output_specs:
        if spec.kind in _MUTATION_KINDS and spec.target is not None:
            writes[spec.target].append("a functionalized mutation")
    by_name = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for spec in program.graph_signature.input_specs:
        if spec.kind in _STATE_KINDS and spec.arg.name in by_name:
            found = in_place_writes(by_name[spec.arg.name])
            if found:
                writes[spec.target].extend(found)
    return dict(writes)


def buffer_writes(program: ExportedProgram) -> dict[str, list[str]]:
    """Buffer FQN -> what in this program may write it (empty lists omitted)."""
    buffers = buffer_placeholders(program)
    return {fqn: ops for fqn, ops in state_writes(program).items() if fqn in buffers}


def mark_buffer_fold_blockers(programs: Mapping[str, ExportedProgram]) -> None:
    """Give every buffer placeholder of every method its fold verdict (see module doc)."""
    writers: dict[str, list[str]] = defaultdict(list)
    readers: dict[str, list[str]] = defaultdict(list)
    for method, program in programs.items():
        for fqn, ops in buffer_writes(program).items():
            writers[fqn].append(f"method `{method}` may write it ({', '.join(sorted(set(ops)))})")
        for fqn, placeholder in buffer_placeholders(program).items():
            if placeholder.users:
                readers[fqn].append(method)
    for program in programs.values():
        for fqn, placeholder in buffer_placeholders(program).items():
            blockers = list(writers.get(fqn, ()))
            if len(readers.get(fqn, ())) > 1:
                blockers.append(f"methods {', '.join(sorted(readers[fqn]))} all read it")
            placeholder.meta[BUFFER_FOLD_BLOCKERS] = tuple(blockers)
