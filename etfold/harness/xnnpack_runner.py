# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Lower to XNNPACK, serialize, and run on the runtime shipped in the executorch wheel."""

from __future__ import annotations

import contextlib
import copy
import math
import types
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from executorch.exir import EdgeProgramManager, ExecutorchProgramManager
from executorch.exir import to_edge_transform_and_lower as upstream_to_edge_transform_and_lower
from torch.export import ExportedProgram

from etfold.harness.inspection import (
    delegate_count,
    ops_outside_delegates,
    ops_outside_reading_no_user_input,
)
from etfold.harness.lowering_speedups import lowering_speedups
from etfold.harness.modules import in_eval_mode

Programs = ExportedProgram | Mapping[str, ExportedProgram]


def default_partitioners() -> list:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return [XnnpackPartitioner()]


@dataclass
class XnnpackProgram:
    """A lowered, serialized program and the runtime module loaded from its buffer.

    The runtime keeps a pointer into `executorch.buffer`, so this object owns both.
    """

    edge: EdgeProgramManager
    executorch: ExecutorchProgramManager
    _runtime: LoadedProgram = field(repr=False)
    # read before to_executorch(), which rewrites the edge programs in place (alloc, .out ops)
    _delegates: dict[str, int] = field(default_factory=dict, repr=False)
    _ops_outside: dict[str, Counter[str]] = field(default_factory=dict, repr=False)
    _constant_work_outside: dict[str, list[tuple[str, str]]] = field(
        default_factory=dict, repr=False
    )

    def run(self, *inputs: torch.Tensor, method: str = "forward") -> list[torch.Tensor]:
        return list(self._runtime.run_method(method, tuple(inputs)))

    @property
    def pte_bytes(self) -> int:
        return len(self.executorch.buffer)

    def delegates(self, method: str = "forward") -> int:
        return self._delegates[method]

    def ops_outside(self, method: str = "forward") -> Counter[str]:
        """Ops left outside delegates in the lowered edge program (before emission)."""
        return Counter(self._ops_outside[method])

    def constant_work_outside(self, method: str = "forward") -> list[tuple[str, str]]:
        """(node name, op) of the ops outside delegates that no user input reaches."""
        return list(self._constant_work_outside[method])


@dataclass
class LoadedProgram:
    """A runtime program together with the program manager whose buffer it points into.

    Every method is loaded up front, as a deployed program would be: loading a method
    (re)initializes the mutable buffers it shares with the others, so a method loaded
    lazily on first call would wipe the state another method had already written.
    """

    executorch: ExecutorchProgramManager
    program: Any = field(repr=False)  # the methods point into it, as it points into the buffer
    methods: dict[str, Any] = field(repr=False)

    def run_method(self, method: str, inputs: tuple) -> list:
        return list(self.methods[method].execute(inputs))


def load_program(executorch: ExecutorchProgramManager) -> LoadedProgram:
    """The program on the wheel's runtime, whose methods share one set of arenas (and so
    the mutable buffers a program exported with `share_mutable_buffers` shares)."""
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(executorch.buffer)
    methods = {name: program.load_method(name) for name in sorted(program.method_names)}
    return LoadedProgram(executorch, program, methods)


def lower_xnnpack(
    programs: Programs,
    partitioners: Sequence | None = None,
    *,
    lower: Callable[..., EdgeProgramManager] = upstream_to_edge_transform_and_lower,
    compile_config=None,
    executorch_config=None,
    keep_declared_bounds: bool = False,
) -> XnnpackProgram:
    """`lower(programs, partitioner=…)` → `to_executorch` → runtime module; with
    `keep_declared_bounds`, both inside `etfold.exir.declared_bounds_kept()`, so a dynamic
    program is planned for the bounds its export declared."""
    from etfold.exir import declared_bounds_kept

    with declared_bounds_kept() if keep_declared_bounds else contextlib.nullcontext():
        return _lowered_and_loaded(programs, partitioners, lower, compile_config, executorch_config)


def is_stock_lowering(lower: Callable, partitioners: Sequence | None) -> bool:
    """Upstream's entry point with upstream's partitioners only: nothing of etfold's."""
    return (
        lower is upstream_to_edge_transform_and_lower
        and partitioners is not None
        and all(type(p).__module__.startswith("executorch.") for p in partitioners)
    )


def _lowered_and_loaded(
    programs: Programs, partitioners, lower, compile_config, executorch_config
) -> XnnpackProgram:
    """The two lowering calls run with etfold's lowering speed-ups (`lowering_speedups`)."""
    stock = is_stock_lowering(lower, partitioners)
    with lowering_speedups(stock=stock):
        edge = lower(
            programs if isinstance(programs, ExportedProgram) else dict(programs),
            partitioner=list(partitioners) if partitioners is not None else default_partitioners(),
            compile_config=compile_config,
        )
    methods = edge.methods
    delegates = {m: delegate_count(edge.exported_program(m)) for m in methods}
    ops_outside = {m: ops_outside_delegates(edge.exported_program(m)) for m in methods}
    constant_work = {
        m: ops_outside_reading_no_user_input(edge.exported_program(m)) for m in methods
    }
    with lowering_speedups(stock=stock):
        executorch = (
            edge.to_executorch(executorch_config) if executorch_config else edge.to_executorch()
        )
    return XnnpackProgram(
        edge, executorch, load_program(executorch), delegates, ops_outside, constant_work
    )


def export_method(module: torch.nn.Module, method: str, inputs: tuple) -> ExportedProgram:
    """Export one method of `module` (forward or any other) as its own program.

    Parameters and buffers keep their own fully qualified names in every method,
    so constants shared across methods are recognisable by name.
    """
    if method == "forward":
        return torch.export.export(module, inputs)
    # A shallow copy shares parameters, buffers and submodules; only its forward differs.
    view = copy.copy(module)
    view.forward = types.MethodType(getattr(type(module), method), view)
    return torch.export.export(view, inputs)


def eager_outputs(
    module: torch.nn.Module, inputs: tuple, method: str = "forward"
) -> list[torch.Tensor]:
    """Eager outputs from a deep copy, so lowering can never influence the reference."""
    with torch.no_grad():
        out = getattr(copy.deepcopy(module), method)(*inputs)
    return [out] if isinstance(out, torch.Tensor) else list(out)


def lower_module_xnnpack(
    module: torch.nn.Module,
    inputs: tuple,
    partitioners: Sequence | None = None,
    **lower_kwargs,
) -> tuple[XnnpackProgram, list[torch.Tensor]]:
    """Export `module.forward`, lower and load it; return it with the eager reference."""
    module = in_eval_mode(module)
    reference = eager_outputs(module, inputs)
    program = lower_xnnpack(export_method(module, "forward", inputs), partitioners, **lower_kwargs)
    return program, reference


def _check_pair(index: int, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """A structural mismatch is a failure, never a number."""
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise AssertionError(
            f"output {index}: {type(actual).__name__} vs expected {type(expected).__name__}"
        )
    if actual.shape != expected.shape:
        raise AssertionError(
            f"output {index}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        )
    if actual.dtype != expected.dtype:
        raise AssertionError(f"output {index}: dtype {actual.dtype} != expected {expected.dtype}")


def _check_outputs(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    if len(actual) != len(expected):
        raise AssertionError(f"{len(actual)} outputs, expected {len(expected)}")
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        _check_pair(index, a, e)


def elementwise_error(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|actual - expected| in float64, where non-finite values count exactly.

    A NaN matches only a NaN at the same place, an infinity only the same
    infinity; any other non-finite mismatch is an infinite error.
    """
    a, e = actual.double(), expected.double()
    both_nan = a.isnan() & e.isnan()
    same_inf = a.isinf() & (a == e)
    diff = (a - e).abs()
    diff = torch.where(both_nan | same_inf, torch.zeros_like(diff), diff)
    return torch.where(diff.isnan(), torch.full_like(diff, math.inf), diff)


def max_abs_error(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> float:
    """The largest elementwise error over all outputs (`inf` for a non-finite mismatch).

    Raises AssertionError when the output counts, shapes or dtypes differ.
    """
    _check_outputs(actual, expected)
    worst = 0.0
    for a, e in zip(actual, expected, strict=True):
        if a.numel():
            worst = max(worst, float(elementwise_error(a, e).max()))
    return worst


def assert_close(
    actual: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    *,
    atol: float,
    rtol: float = 0.0,
) -> None:
    """Same count, shapes and dtypes, NaN only where expected is NaN, then within tolerance."""
    _check_outputs(actual, expected)
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(
            a, e, atol=atol, rtol=rtol, equal_nan=True, msg=lambda m, i=index: f"output {i}: {m}"
        )
