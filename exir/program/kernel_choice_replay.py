# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Which declared bound a convolution's kernel choice would narrow, made with its guards.

`to_executorch` retraces each delegate's original program, outside any scope of
etfold's, so torch's fake convolution chooses its CPU kernel again, with guards.
Each choice the lowering made (a `KernelChoice`) is made once more here, on fake
tensors of the same size expressions, hints and declared ranges, in a shape
environment of its own: the same guards, none of them in the user's environment.
A range it narrows below its declared upper bound is one `to_executorch` would
plan for.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv


@dataclass(frozen=True)
class KernelChoice:
    """One call of torch's convolution kernel choice on fake tensors of symbolic size."""

    input: torch.Tensor
    weight: torch.Tensor
    options: tuple[tuple[str, object], ...]


@dataclass(frozen=True)
class DeclaredSize:
    """A symbol a program's user input takes as a dim, and the range the export declared."""

    symbol: sympy.Symbol
    env: object  # the shape environment whose ranges memory planning reads
    declared: object  # ValueRanges
    named: str  # "dim d of `x`"


class _Replay:
    """A shape environment of its own holding the sizes of the choices it replays."""

    def __init__(self, declared: dict[sympy.Symbol, DeclaredSize]):
        self.env = ShapeEnv()
        self.declared = declared
        self.symbols: dict[sympy.Symbol, sympy.Symbol] = {}

    def _symbol(self, symbol: sympy.Symbol, env) -> sympy.Symbol:
        if symbol not in self.symbols:
            hint = int(env.backed_var_to_val[symbol])
            mine = self.env.create_symbol(
                hint, ConstantSource(f"replayed_{symbol}"), dynamic_dim=DimDynamic.DYNAMIC
            )
            size = self.declared.get(symbol)
            bound = size.declared if size is not None else env.var_to_range[symbol]
            self.env.constrain_symbol_range(mine, int(bound.lower), int(bound.upper))
            self.symbols[symbol] = mine
        return self.symbols[symbol]

    def size(self, size: object) -> object:
        if not isinstance(size, torch.SymInt):
            return size
        expr, env = size.node.expr, size.node.shape_env
        mapping = {symbol: self._symbol(symbol, env) for symbol in expr.free_symbols}
        return self.env.create_symintnode(expr.xreplace(mapping), hint=size.node.hint)

    def tensor(self, value: torch.Tensor) -> torch.Tensor:
        shape = [self.size(s) for s in value.shape]
        stride = [self.size(s) for s in value.stride()]
        return torch.empty_strided(shape, stride, dtype=value.dtype, device="cpu")

    def narrowed(self) -> list[str]:
        found = []
        for symbol, mine in self.symbols.items():
            size = self.declared.get(symbol)
            upper = self.env.var_to_range[mine].upper
            if size is None or upper >= size.declared.upper:
                continue
            guard = next((g.expr for g in self.env.guards if mine in g.expr.free_symbols), None)
            said = f" `{str(guard).replace(str(mine), str(symbol))}`" if guard is not None else ""
            found.append(
                f"{size.named} is declared up to {size.declared.upper}, but `to_executorch` "
                f"would plan it for {upper}: torch's fake convolution chooses its CPU kernel "
                f"with the guard{said} at the traced size. Lower and call `to_executorch` "
                "inside `etfold.exir.declared_bounds_kept()`"
            )
        return found


def _replayed(choice: KernelChoice, replay: _Replay, original) -> None:
    with FakeTensorMode(shape_env=replay.env, allow_non_fake_inputs=False):
        options = {
            name: replay.tensor(value) if isinstance(value, torch.Tensor) else value
            for name, value in choice.options
        }
        original(replay.tensor(choice.input), replay.tensor(choice.weight), **options)


def _symbols_read(choice: KernelChoice) -> tuple[object, set[sympy.Symbol]]:
    """The shape environment of `choice`'s symbolic sizes and strides, and their symbols."""
    env, found = None, set()
    for value in (choice.input, choice.weight):
        for size in (*value.shape, *value.stride()):
            if isinstance(size, torch.SymInt):
                env = size.node.shape_env
                found |= size.node.expr.free_symbols
    return env, found


def narrowed_by_kernel_choices(
    choices: list[KernelChoice], sizes: list[DeclaredSize], original
) -> str:
    """Why `to_executorch` would plan a declared size below its bound ("" when none):
    each choice of `choices` that reads a size of `sizes`, made with its guards by torch's
    `original` kernel choice (a choice over a size with no hint takes no guard: skipped)."""
    for choice in choices:
        env, read = _symbols_read(choice)
        declared = {size.symbol: size for size in sizes if size.env is env}
        if not read & declared.keys() or not read <= env.backed_var_to_val.keys():
            continue
        replay = _Replay(declared)
        _replayed(choice, replay, original)
        found = replay.narrowed()
        if found:
            return found[0]
    return ""
