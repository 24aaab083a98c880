# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A value computed from constants and the program's sizes, at every size its bounds allow.

    m(s) = f(constants, s)        for each s in lo..hi of every symbol f reads

A dynamic export builds attention's mask from `arange(ids.size(1))` and the
like (HF's causal and all-ones padding masks): no constant, yet a function of
the sequence length alone. A fact that must hold for every program the bounds
admit is checked at each of them, which is exact; a budget of sizes and
elements bounds the work, and past it the caller declines naming the dims.
Each node is computed by constant propagation's own `evaluate`, each size read
(`sym_size`) given its value at that size.

A value may read sizes derived from the symbols rather than the symbols: a frame
count `L // 20 - 1` of an audio length `L` (convolutions' output lengths). Then
the lengths that give every derived size it reads the same value give it the same
value too, and one of each such class is checked: a length in 4000..32000 gives
1401 frame counts. The classes come from the derived sizes' expressions computed at
every length at once (torch's tensor reference of sympy, exact in int64).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import sympy
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Node
from torch.utils._sympy.interp import sympy_interp
from torch.utils._sympy.reference import TensorReferenceAnalysis

from etfold.decisions import Declined
from etfold.exir.passes.constant_prop.evaluate import evaluate
from etfold.exir.passes.constant_prop.verdicts import EVERY_METHOD, source_verdict
from etfold.exir.passes.graph_walk import (
    FILLS_SHAPED_LIKE_OPERAND,
    SHAPE_ONLY_READERS,
    StateFacts,
    input_kinds,
    value_ancestors,
    value_inputs,
)
from etfold.exir.passes.node_shapes import node_value

aten = torch.ops.aten

MAX_SIZES = 4096  # size assignments checked, across all symbols
MAX_ELEMENTS = 1 << 25  # mask elements computed, summed over the assignments
MAX_SYMBOL_VALUES = 1 << 22  # assignments whose derived sizes are computed, to find their classes


# ops whose result holds exactly the elements of their first argument (broadcast or viewed)
_SAME_ELEMENTS = {
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.view.default,
    aten.reshape.default,
    aten.alias.default,
}


def elements_source(node: Node) -> Node:
    """The value whose elements `node` holds, through broadcasts and views: a property of
    every element (all True) holds for `node` when it holds for the source, which is
    cheaper to check at every size (an [s, 1] mask expanded to [s, s])."""
    while node.target in _SAME_ELEMENTS and isinstance(node.args[0], Node):
        node = node.args[0]
    return node


def reads_sizes_only(node: Node, cone: set[Node]) -> bool:
    """Every reader of `node` inside `cone` reads only its shape (`value_inputs`)."""
    return all(node not in value_inputs(user) for user in node.users if user in cone)


def size_reads(cone: set[Node]) -> list[Node]:
    """The nodes of `cone` that read an operand's shape, not its values (`value_inputs`)."""
    return [node for node in cone if node.target in SHAPE_ONLY_READERS]


def _sizes_read(read: Node) -> list[tuple[int, object]]:
    """(dim, size) of each size of its operand that `read` takes: the one a `sym_size`
    reads, every dim a fill shaped like its operand has (a `new_*` fill takes its sizes
    as arguments, read by nodes of their own)."""
    if read.target is aten.sym_size.int:
        return [(read.args[1], node_value(read))]
    if read.target in FILLS_SHAPED_LIKE_OPERAND:
        return list(enumerate(node_value(read).shape))
    return []


def _symbolic_sizes(reads: list[Node]) -> list[tuple[Node, int, torch.SymInt]]:
    return [
        (read, dim, size)
        for read in reads
        for dim, size in _sizes_read(read)
        if isinstance(size, torch.SymInt)
    ]


def _symbols(reads: list[Node]) -> list[sympy.Symbol]:
    found: set[sympy.Symbol] = set()
    for _, _, size in _symbolic_sizes(reads):
        found |= size.node.expr.free_symbols
    return sorted(found, key=str)


def _shape_env(reads: list[Node]):
    (env, *_) = {size.node.shape_env for _, _, size in _symbolic_sizes(reads)}
    return env


def _read_of(symbol: sympy.Symbol, reads: list[Node]) -> str:
    """ "dim d of `x`" for the first size read that is `symbol` itself."""
    for read, dim, size in _symbolic_sizes(reads):
        if size.node.expr == symbol:
            return f"dim {dim} of `{read.args[0].name}`"
    return "a size"


def _is_symbolic_scalar(node: Node) -> bool:
    return isinstance(node_value(node), torch.SymInt | torch.SymBool | torch.SymFloat)


def sizes_read_by_tensor_ops(cone: set[Node]) -> list[object]:
    """The symbolic sizes that an op of `cone` computing a tensor reads: a symbolic
    scalar of `cone` (a size read, or arithmetic on sizes) it takes, the dims of an
    operand it is shaped like. Every tensor of `cone` is a function of their values
    alone (and of constants), since a user input in it is read for its sizes only."""
    scalars = sorted(
        (
            node
            for node in cone
            if _is_symbolic_scalar(node)
            and any(user in cone and not _is_symbolic_scalar(user) for user in node.users)
        ),
        key=lambda node: node.name,
    )
    fills = sorted(
        (n for n in cone if n.target in FILLS_SHAPED_LIKE_OPERAND), key=lambda node: node.name
    )
    return [node_value(n) for n in scalars] + [s for _, _, s in _symbolic_sizes(fills)]


def _ranges(
    symbols: list[sympy.Symbol], reads: list[Node], declared: Mapping | None
) -> list[range] | Declined:
    """Each symbol's sizes: the range its export declared where given, else its shape
    environment's (which a guard taken since may have narrowed, while the runtime still
    takes every declared size)."""
    env, ranges = _shape_env(reads), []
    for symbol in symbols:
        bound = (declared or {}).get(symbol) or env.bound_sympy(symbol)
        if not bound.upper.is_finite:
            return Declined(f"dynamic shape: {symbol} has no upper bound to check the mask below")
        ranges.append(range(int(bound.lower), int(bound.upper) + 1))
    return ranges


def _too_many(symbols, ranges, reads, count: int, what: str) -> Declined:
    named = ", ".join(
        f"{_read_of(symbol, reads)} ({symbol} in {r.start}..{r.stop - 1})"
        for symbol, r in zip(symbols, ranges, strict=True)
    )
    return Declined(f"dynamic shape: {named}: {count} {what}, over {MAX_SIZES} to check")


def _grid(ranges: list[range]) -> list[torch.Tensor]:
    """Every assignment of the ranges, one int64 column per symbol (the first symbol's
    values vary slowest, as `itertools.product` orders them)."""
    axes = [torch.arange(r.start, r.stop, dtype=torch.int64) for r in ranges]
    return [column.reshape(-1) for column in torch.meshgrid(*axes, indexing="ij")]


def _first_of_each_class(keys: torch.Tensor) -> list[int]:
    """The index of the first row of each distinct row of `keys`, in row order."""
    if keys.shape[1] == 0:
        return [0]
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), keys.shape[0], dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(keys.shape[0]), "amin")
    return sorted(first.tolist())


def _size_classes(
    symbols: list[sympy.Symbol], ranges: list[range], derived: list[object]
) -> list[dict] | None:
    """One assignment of each class of assignments that give `derived` the same values
    (the first of the class), in assignment order; None when a size's expression is
    not one torch's tensor reference evaluates, or not an integer or a boolean."""
    if any(isinstance(size, torch.SymFloat) for size in derived):
        return None  # its values would not be told apart as integers
    grid = _grid(ranges)
    env = dict(zip(symbols, grid, strict=True))
    columns = []
    for size in derived:
        if not isinstance(size, torch.SymInt | torch.SymBool):
            continue  # a static dim: the same in every class
        try:
            value = sympy_interp(TensorReferenceAnalysis, env, size.node.expr)
        except (NotImplementedError, AttributeError, TypeError, KeyError):
            return None
        columns.append(torch.as_tensor(value, dtype=torch.int64).expand(grid[0].shape))
    keys = torch.stack(columns, 1) if columns else grid[0].new_empty(grid[0].shape[0], 0)
    return [
        {symbol: int(column[row]) for symbol, column in env.items()}
        for row in _first_of_each_class(keys)
    ]


def size_assignments(
    reads: list[Node], cone: set[Node] | None = None, declared: Mapping | None = None
) -> list[dict] | Declined:
    """Every value of the symbols `reads` depend on, within the export's bounds; or, given
    the `cone` those reads are in, one assignment of each class whose sizes read by the
    cone's tensor ops (`sizes_read_by_tensor_ops`) are equal, which the cone cannot tell
    apart: a frame count `L // 20 - 1` of a length `L` in 4000..32000 takes 1401 values.
    `declared`: the program's range constraints."""
    symbols = _symbols(reads)
    if not symbols:
        return [{}]  # every size read is static: one value
    ranges = _ranges(symbols, reads, declared)
    if isinstance(ranges, Declined):
        return ranges
    count = math.prod(len(r) for r in ranges)
    if cone is not None and MAX_SIZES < count <= MAX_SYMBOL_VALUES:
        classes = _size_classes(symbols, ranges, sizes_read_by_tensor_ops(cone))
        if classes is not None and len(classes) > MAX_SIZES:
            what = "distinct sizes" if len(classes) < count else "sizes"
            return _too_many(symbols, ranges, reads, len(classes), what)
        if classes is not None:
            return classes
    if count > MAX_SIZES:
        return _too_many(symbols, ranges, reads, count, "sizes")
    return [dict(zip(symbols, values, strict=True)) for values in itertools.product(*ranges)]


def concrete(size: object, assignment: Mapping) -> int:
    """`size` (an int or a SymInt) at `assignment`."""
    if type(size) is int:
        return size
    return int(size.node.expr.xreplace(assignment))


def _elements(mask: Node, assignments: list[dict]) -> int:
    shape = node_value(mask).shape
    return sum(math.prod(concrete(s, a) for s in shape) for a in assignments)


def values_at_every_size(
    mask: Node,
    cone: set[Node],
    sources: Mapping[Node, torch.Tensor],
    declared: Mapping | None = None,
) -> list[tuple[dict, torch.Tensor]] | Declined:
    """(assignment, `mask`'s value there) for every size assignment; `cone` is the
    mask and all it reads, `sources` the values of its constant placeholders (the
    other placeholders are read for their sizes only), `declared` the program's range
    constraints."""
    reads = size_reads(cone)
    assignments = size_assignments(reads, cone, declared)
    if isinstance(assignments, Declined):
        return assignments
    if (elements := _elements(mask, assignments)) > MAX_ELEMENTS:
        return Declined(
            f"dynamic shape: the mask takes {elements} elements over its "
            f"{len(assignments)} sizes, over {MAX_ELEMENTS} to check"
        )
    found = []
    for assignment in assignments:
        value = _value_at(mask, cone, sources, reads, assignment)
        if isinstance(value, Declined):
            return Declined(f"the mask at {assignment}: {value.reason}")
        found.append((assignment, value))
    return found


def _value_at(
    node: Node, cone: set[Node], sources: Mapping, reads: list[Node], assignment: Mapping
) -> object:
    """`node`'s value with each size read at `assignment`, or a Declined."""
    ordered = [n for n in node.graph.nodes if n in cone and n.op == "call_function"]
    values: dict[Node, object] = dict(sources)
    for read in reads:
        if read.target is aten.sym_size.int:
            values[read] = concrete(node_value(read), assignment)
        elif isinstance(operand := read.args[0], Node) and operand not in values:
            values[operand] = _stand_in(
                operand, read.target in FILLS_SHAPED_LIKE_OPERAND, assignment
            )
    for current in ordered:
        if current not in values:
            value = evaluate(current, values)
            if isinstance(value, Declined):
                return value
            values[current] = value
    return values[node]


def _stand_in(operand: Node, shaped: bool, assignment: Mapping) -> torch.Tensor:
    """Uninitialized, for an `operand` read for its dtype and device, and its shape at
    `assignment` when `shaped` (else empty)."""
    value = node_value(operand)
    shape = [concrete(size, assignment) for size in value.shape] if shaped else [0]
    return torch.empty(shape, dtype=value.dtype, device=value.device)


def user_value_readers(program: ExportedProgram) -> set[Node]:
    """The nodes that are, or compute from, the values of a user input (a size read or a
    fill shaped like it reads none: `value_inputs`)."""
    kinds, found = input_kinds(program), set()
    for node in program.graph.nodes:
        if node.op == "placeholder":
            if kinds.get(node.name) == InputKind.USER_INPUT:
                found.add(node)
        elif any(n in found for n in value_inputs(node)):
            found.add(node)
    return found


def reads_user_values(node: Node, program: ExportedProgram) -> bool:
    """`node` is, or computes from, the values of a user input (not its sizes alone)."""
    return node in user_value_readers(program)


def known_at_every_size(
    program: ExportedProgram, node: Node, facts: StateFacts
) -> list[tuple[dict, torch.Tensor]] | Declined:
    """(assignment, `node`'s value there) for every size its bounds allow, or the one
    value (at `{}`) when it reads no size; Declined when it reads a user input's values,
    or a placeholder not known when lowering in every method."""
    cone = value_ancestors(node)
    kinds = input_kinds(program)
    sources = {}
    for placeholder in (n for n in cone if n.op == "placeholder"):
        if placeholder is not node and reads_sizes_only(placeholder, cone):
            continue
        if kinds.get(placeholder.name) == InputKind.USER_INPUT:
            return Declined(f"`{node.name}` reads the values of user input {placeholder.name}")
        verdict = source_verdict(program, placeholder, EVERY_METHOD, facts)
        if verdict is None or isinstance(verdict, Declined):
            why = verdict.reason if verdict is not None else "not a constant"
            return Declined(f"`{node.name}` is not known when lowering: {why}")
        sources[placeholder] = verdict.tensor
    return values_at_every_size(node, cone, sources, program.range_constraints)
