# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A lowered program keeps the size bounds its export declared, or the lowering refuses.

ExecuTorch plans each dynamic tensor's memory at its size's upper bound, read from
the shape environment's ranges (`eval_upper_bound`), not from the program's range
constraints. A guard taken after export narrows those ranges, in the environment
the user's program shares: the program then refuses sizes its bounds allow
("Attempted to resize a bounded tensor with a maximum capacity of ...").

One such guard is known, and has no bearing on the program: torch's fake
convolution asks which CPU kernel it would run (`_select_conv_backend`, which
prefers the native kernel up to 20480 input elements) only to pick its fake output's
memory format. Every retrace of a convolution over a dynamic size asks it again, at
the traced size: XNNPACK's preprocess (it unsqueezes a 1-D convolution) and
`to_executorch` (it traces each delegate's original program). Audio exported at
16,000 samples and declared up to 32,000 is then planned for 20,480.

Inside `declared_bounds_kept()` that choice is made with guards suppressed: the
same answer at the traced size, so the same fake values, and no range narrowed.
Lower and call `to_executorch` inside it, and the program runs at every size its
bounds allow. etfold's entry point enters it around the lowering (`bounds_kept`),
and refuses (`DeclaredBoundNarrowed`, naming the input, its dim, the declared bound
and the guard) when the lowering narrowed a declared upper bound, or when, outside
the scope, `to_executorch` would: each kernel choice the lowering made over a
declared size is made again with its guard, in a shape environment of its own.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping

import sympy
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from etfold.exir.passes.graph_walk import input_kinds
from etfold.exir.passes.node_shapes import node_value
from etfold.exir.program.kernel_choice_replay import (
    DeclaredSize,
    KernelChoice,
    narrowed_by_kernel_choices,
)
from etfold.exir.program.reentrant_patch import PatchUnavailable, ReentrantPatch, Replacement


class DeclaredBoundNarrowed(ValueError):
    """The lowered program would refuse sizes its export's bounds allow."""


_choices: contextvars.ContextVar[list[KernelChoice] | None] = contextvars.ContextVar(
    "etfold_conv_kernel_choices", default=None
)


def _shape_env_of(*tensors: object):
    for tensor in tensors:
        for size in getattr(tensor, "shape", ()):
            if isinstance(size, torch.SymInt):
                return size.node.shape_env
    return None


def _choosing_without_guards(original):
    def choose(*args, **options):
        env = _shape_env_of(*args[:2])
        if env is None:
            return original(*args, **options)
        recorded = _choices.get()
        if recorded is not None and len(args) == 2:
            recorded.append(KernelChoice(*args, tuple(options.items())))
        with env.suppress_guards():
            return original(*args, **options)

    return choose


PATCH = ReentrantPatch(
    "conv_kernel_choice_keeps_bounds",
    lambda: [Replacement(torch._C, "_select_conv_backend", _choosing_without_guards)],
)


def _patch_scope() -> contextlib.AbstractContextManager:
    """`PATCH`'s scope; nothing where torch lacks what it replaces (bounds are then still
    checked)."""
    try:
        PATCH.check()
    except PatchUnavailable:
        return contextlib.nullcontext()
    return PATCH.scope()


@contextlib.contextmanager
def declared_bounds_kept() -> Iterator[None]:
    """Lower and plan (`to_executorch`) inside: torch's fake convolution chooses its
    kernel without narrowing a size's range, so memory is planned for the declared bounds."""
    with _patch_scope():
        yield


def declared_sizes(program: ExportedProgram) -> list[DeclaredSize]:
    """Each symbol a user input of `program` has as a dim, with its declared range."""
    kinds, found, seen = input_kinds(program), [], set()
    for node in program.graph.find_nodes(op="placeholder"):
        value = node_value(node)
        if kinds.get(node.name) != InputKind.USER_INPUT or not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            if not isinstance(size, torch.SymInt) or not isinstance(size.node.expr, sympy.Symbol):
                continue
            symbol = size.node.expr
            if symbol in seen or symbol not in program.range_constraints:
                continue
            seen.add(symbol)
            declared = program.range_constraints[symbol]
            named = f"dim {dim} of `{node.name}`"
            found.append(DeclaredSize(symbol, size.node.shape_env, declared, named))
    return found


def _narrowing_guard(guards, symbol: sympy.Symbol) -> str:
    for guard in guards:
        if symbol in guard.expr.free_symbols:
            return f" (the guard `{guard.expr}`)"
    return ""


def _put_back(size: DeclaredSize, previous) -> None:
    if previous is None:
        size.env.var_to_range.pop(size.symbol, None)
    else:
        size.env.var_to_range[size.symbol] = previous
    # the environment's caches (what it knows statically) are keyed by this counter, and
    # may hold answers another range gave
    size.env._version_counter += 1


def _narrowed_while_lowering(sizes: list[DeclaredSize], before: dict, guards: dict) -> list[str]:
    """Why each declared upper bound the lowering narrowed is refused; every range put
    back as it was before the lowering."""
    refused = []
    for size in sizes:
        now = size.env.var_to_range.get(size.symbol)
        if now is not None and now.upper < size.declared.upper:
            taken = size.env.guards[guards[id(size.env)] :]
            refused.append(
                f"{size.named} is declared up to {size.declared.upper}, but the lowering "
                f"narrowed {size.symbol} to {now.upper}{_narrowing_guard(taken, size.symbol)}: "
                "the program would refuse the sizes above it"
            )
        if now != before[_key(size)]:
            _put_back(size, before[_key(size)])
    return refused


def _key(size: DeclaredSize) -> tuple[int, sympy.Symbol]:
    return id(size.env), size.symbol  # two methods' exports may name their symbols alike


def _narrowed_before(sizes: list[DeclaredSize], before: dict) -> str:
    """Why a lowering is refused before it starts: a declared upper bound its shape
    environment holds lower, which `to_executorch` would plan for."""
    for size in sizes:
        now, declared = before[_key(size)], size.declared
        if now is not None and now.upper < declared.upper:
            return (
                f"{size.named} is declared up to {declared.upper}, but its shape environment "
                f"already bounds {size.symbol} by {now.upper} (a guard an earlier lowering or "
                "`to_executorch` of this export took): lower a fresh export"
            )
    return ""


def _widen_to_declared(sizes: list[DeclaredSize], before: dict) -> None:
    """A lower bound a guard raised since export (at the traced size, above a kernel
    choice's threshold) is the declared one while lowering: the sizes below it still run,
    and each fact checked at every size must hold there too."""
    for size in sizes:
        now = before[_key(size)]
        if now is not None and now.lower > size.declared.lower:
            _put_back(size, size.declared)


def _narrowed_by_to_executorch(recorded: list[KernelChoice], sizes: list[DeclaredSize]) -> str:
    try:
        PATCH.check()
    except PatchUnavailable:
        return ""  # torch has no such choice to make again
    original = PATCH.original(torch._C, "_select_conv_backend")
    return narrowed_by_kernel_choices(recorded, sizes, original)


@contextlib.contextmanager
def bounds_kept(programs: Mapping[str, ExportedProgram]) -> Iterator[None]:
    """Run a lowering of `programs` inside `declared_bounds_kept()`, each declared size
    over its declared range; on leaving, every range is as before. `DeclaredBoundNarrowed`
    is raised when a declared upper bound is narrowed before the lowering, by it, or
    (called outside `declared_bounds_kept()`) by the `to_executorch` to come."""
    sizes = [size for program in programs.values() for size in declared_sizes(program)]
    before = {_key(size): size.env.var_to_range.get(size.symbol) for size in sizes}
    if refused := _narrowed_before(sizes, before):
        raise DeclaredBoundNarrowed(refused)
    _widen_to_declared(sizes, before)
    guards = {id(size.env): len(size.env.guards) for size in sizes}
    planned_inside = PATCH.active()
    recorded: list[KernelChoice] = []
    token = _choices.set(recorded)
    try:
        with declared_bounds_kept():
            yield
    finally:
        _choices.reset(token)
        narrowed = _narrowed_while_lowering(sizes, before, guards)
    if narrowed:
        raise DeclaredBoundNarrowed(narrowed[0])
    if not planned_inside and (refused := _narrowed_by_to_executorch(recorded, sizes)):
        raise DeclaredBoundNarrowed(refused)
