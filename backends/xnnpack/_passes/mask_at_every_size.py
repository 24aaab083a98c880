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
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import sympy
import torch
from torch.fx import Node

from etfold.decisions import Declined
from etfold.exir.passes.constant_prop.evaluate import evaluate

aten = torch.ops.aten

MAX_SIZES = 4096  # size assignments checked, across all symbols
MAX_ELEMENTS = 1 << 25  # mask elements computed, summed over the assignments


def reads_sizes_only(node: Node, cone: set[Node]) -> bool:
    """Every reader of `node` inside `cone` reads only one of its sizes."""
    return all(user.target is aten.sym_size.int for user in node.users if user in cone)


def size_reads(cone: set[Node]) -> list[Node]:
    return [node for node in cone if node.target is aten.sym_size.int]


def _symbols(reads: list[Node]) -> list[sympy.Symbol]:
    found: set[sympy.Symbol] = set()
    for read in reads:
        value = read.meta.get("val")
        if isinstance(value, torch.SymInt):
            found |= value.node.expr.free_symbols
    return sorted(found, key=str)


def _shape_env(reads: list[Node]):
    (env, *_) = {read.meta["val"].node.shape_env for read in reads}
    return env


def _read_of(symbol: sympy.Symbol, reads: list[Node]) -> str:
    """ "dim d of `x`" for the first size read that is `symbol` itself."""
    for read in reads:
        if read.meta["val"].node.expr == symbol:
            return f"dim {read.args[1]} of `{read.args[0].name}`"
    return "a size"


def size_assignments(reads: list[Node]) -> list[dict] | Declined:
    """Every value of the symbols `reads` depend on, within the export's bounds."""
    symbols = _symbols(reads)
    if not symbols:
        return Declined("the sizes the mask reads have no symbols")
    env = _shape_env(reads)
    ranges = []
    for symbol in symbols:
        bound = env.bound_sympy(symbol)
        if not bound.upper.is_finite:
            return Declined(f"dynamic shape: {symbol} has no upper bound to check the mask below")
        ranges.append(range(int(bound.lower), int(bound.upper) + 1))
    count = math.prod(len(r) for r in ranges)
    if count > MAX_SIZES:
        named = ", ".join(
            f"{_read_of(symbol, reads)} ({symbol} in {r.start}..{r.stop - 1})"
            for symbol, r in zip(symbols, ranges, strict=True)
        )
        return Declined(f"dynamic shape: {named}: {count} sizes, over {MAX_SIZES} to check")
    return [dict(zip(symbols, values, strict=True)) for values in itertools.product(*ranges)]


def concrete(size: object, assignment: Mapping) -> int:
    """`size` (an int or a SymInt) at `assignment`."""
    if type(size) is int:
        return size
    return int(size.node.expr.xreplace(assignment))


def _elements(mask: Node, assignments: list[dict]) -> int:
    shape = mask.meta["val"].shape
    return sum(math.prod(concrete(s, a) for s in shape) for a in assignments)


def values_at_every_size(
    mask: Node, cone: set[Node], sources: Mapping[Node, torch.Tensor]
) -> list[tuple[dict, torch.Tensor]] | Declined:
    """(assignment, `mask`'s value there) for every size assignment; `cone` is the
    mask and all it reads, `sources` the values of its constant placeholders (the
    other placeholders are read for their sizes only)."""
    reads = size_reads(cone)
    assignments = size_assignments(reads)
    if isinstance(assignments, Declined):
        return assignments
    if (elements := _elements(mask, assignments)) > MAX_ELEMENTS:
        return Declined(
            f"dynamic shape: the mask takes {elements} elements over its "
            f"{len(assignments)} sizes, over {MAX_ELEMENTS} to check"
        )
    ordered = [node for node in mask.graph.nodes if node in cone and node.op == "call_function"]
    found = []
    for assignment in assignments:
        values: dict[Node, object] = dict(sources)
        values.update({read: concrete(read.meta["val"], assignment) for read in reads})
        for node in ordered:
            if node not in values:
                value = evaluate(node, values)
                if isinstance(value, Declined):
                    return Declined(f"the mask at {assignment}: {value.reason}")
                values[node] = value
        found.append((assignment, values[mask]))
    return found
