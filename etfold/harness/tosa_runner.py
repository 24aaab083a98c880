# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Quantize for TOSA, lower with the Arm backend, and run on `tosa_reference_model`.

The top-level edge graph is interpreted op by op; each TOSA delegate call is
replaced by a run of its serialized graph on the reference model, so the
quantize/dequantize around the delegate execute exactly as they would on target.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from executorch.exir import EdgeProgramManager
from executorch.exir import to_edge_transform_and_lower as upstream_to_edge_transform_and_lower
from torch.export import ExportedProgram

from etfold.exir.passes.node_shapes import node_value
from etfold.harness.histogram_search import histogram_search_on_numbers
from etfold.harness.inspection import (
    delegate_count,
    lowered_modules,
    ops_outside_delegates,
    tosa_channel_conflicts,
    tosa_operator_counts,
    tosa_unsized_inputs,
)
from etfold.harness.lowering_speedups import lowering_speedups
from etfold.harness.modules import in_eval_mode
from etfold.harness.xnnpack_runner import max_abs_error

INT = "TOSA-1.0+INT"
FP = "TOSA-1.0+FP"

_DELEGATE_CALL = torch.ops.higher_order.executorch_call_delegate


def compile_spec(profile: str):
    from executorch.backends.arm.tosa.compile_spec import TosaCompileSpec

    return TosaCompileSpec(profile)


def tosa_quantizer(profile: str = INT):
    """Symmetric int8 activations, per-channel weights: the configuration users ship."""
    from executorch.backends.arm.quantizer import TOSAQuantizer, get_symmetric_quantization_config

    quantizer = TOSAQuantizer(compile_spec(profile))
    quantizer.set_global(get_symmetric_quantization_config(is_per_channel=True))
    return quantizer


def quantize_for_tosa(
    module: torch.nn.Module,
    inputs: tuple,
    *,
    calibration: Iterable[tuple] = (),
    profile: str = INT,
) -> ExportedProgram:
    """export → prepare_pt2e (runs the Arm annotation pipeline) → calibrate → convert → export."""
    exported = torch.export.export(in_eval_mode(module), inputs)
    return quantize_exported_for_tosa(exported, inputs, calibration=calibration, profile=profile)


def _model_buffers(prepared: torch.nn.Module) -> list[torch.Tensor]:
    """The model's own buffers in a prepared module: every buffer no observer owns."""
    from torchao.quantization.pt2e import FakeQuantizeBase
    from torchao.quantization.pt2e.observer import ObserverBase

    statistics = (ObserverBase, FakeQuantizeBase)
    return [
        buffer
        for module in prepared.modules()
        if not isinstance(module, statistics)
        for buffer in module.buffers(recurse=False)
    ]


@contextlib.contextmanager
def _model_buffers_restored(prepared: torch.nn.Module):
    """Calibration runs the model, and a stateful model advances its buffers; the
    lowered program must start from the exported state, not the calibrated one.
    Observers keep what they saw."""
    buffers = _model_buffers(prepared)
    saved = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, saved, strict=True):
                buffer.copy_(value)


def quantize_exported_for_tosa(
    exported: ExportedProgram,
    inputs: tuple,
    *,
    calibration: Iterable[tuple] = (),
    profile: str = INT,
) -> ExportedProgram:
    """`quantize_for_tosa` from an already exported program (e.g. after marking its nodes)."""
    return quantize_exported(exported, tosa_quantizer(profile), inputs, calibration)


def quantize_exported(
    exported: ExportedProgram, quantizer, inputs: tuple, calibration: Iterable[tuple] = ()
) -> ExportedProgram:
    """prepare_pt2e with `quantizer` → calibrate on `inputs` and `calibration` → convert →
    export. The model's buffers end as exported; observers keep what they saw."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    # Arm's scalar handling rejects the `_guards_fn` submodule that module() keeps by default.
    prepared = prepare_pt2e(exported.module(check_guards=False), quantizer)
    with torch.no_grad(), _model_buffers_restored(prepared):
        prepared(*inputs)
        for sample in calibration:
            prepared(*sample)
    with histogram_search_on_numbers():
        converted = convert_pt2e(prepared)
    return torch.export.export(converted, inputs)


def run_exported(program: ExportedProgram, inputs: tuple) -> list[torch.Tensor]:
    """Run an exported program in torch: for a quantized program, the fake-quantized
    eager reference that an integer lowering should match to within one LSB."""
    with torch.no_grad():
        out = program.module(check_guards=False)(*inputs)
    return [out] if isinstance(out, torch.Tensor) else list(out)


@dataclass(frozen=True)
class TosaResult:
    outputs: list[torch.Tensor]  # the program's outputs (dequantized for INT)
    codes: list[torch.Tensor]  # every delegate's raw outputs, in call order (int8 codes for INT)


def _to_reference_array(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes in its own dim order, as TOSA lays them out."""
    order = tensor.dim_order()
    return tensor.permute(order).contiguous().numpy()


def _from_reference_array(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    order = like.dim_order()
    physical = [like.shape[d] for d in order]
    restored = torch.from_numpy(np.ascontiguousarray(array).reshape(physical))
    inverse = [order.index(d) for d in range(len(order))]
    return restored.permute(inverse)


@contextlib.contextmanager
def _native_stdout_silenced():
    """The reference model prints version notices on C-level stdout; keep them out of ours."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def run_tosa_graph(
    tosa_graph: bytes, inputs: Sequence[torch.Tensor], output_like: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    import tosa_reference_model

    unsized = tosa_unsized_inputs(tosa_graph)
    if unsized:
        raise RuntimeError(
            f"the reference model runs static shapes only, not run: {', '.join(unsized)} unsized"
        )
    conflicts = tosa_channel_conflicts(tosa_graph)
    if conflicts:
        raise RuntimeError(f"malformed TOSA graph, not run: {'; '.join(conflicts)}")
    with _native_stdout_silenced():
        arrays, status = tosa_reference_model.run(
            tosa_graph,
            [_to_reference_array(t) for t in inputs],
            verbosity="NONE",
            initialize_variable_tensor_from_numpy=True,
        )
    if status != tosa_reference_model.GraphStatus.TOSA_VALID:
        raise RuntimeError(f"tosa_reference_model rejected the graph: {status}")
    return [_from_reference_array(a, like) for a, like in zip(arrays, output_like, strict=True)]


class _ReferenceModelInterpreter(torch.fx.Interpreter):
    """Runs a lowered graph module, executing TOSA delegates on the reference model."""

    def __init__(self, graph_module: torch.fx.GraphModule):
        super().__init__(graph_module)
        self.codes: list[torch.Tensor] = []
        self.delegates_run = 0

    def call_function(self, target, args, kwargs):
        if target is not _DELEGATE_CALL:
            return super().call_function(target, args, kwargs)
        lowered, *delegate_inputs = args
        if lowered.backend_id != "TOSABackend":
            raise RuntimeError(f"not a TOSA delegate: {lowered.backend_id}")
        output_node = lowered.original_module.graph.output_node()
        output_like = [node_value(n) for n in output_node.args[0]]
        outputs = run_tosa_graph(lowered.processed_bytes, delegate_inputs, output_like)
        self.codes.extend(outputs)
        self.delegates_run += 1
        return tuple(outputs)


def _run_once(graph_module: torch.fx.GraphModule, inputs: Sequence[torch.Tensor]) -> TosaResult:
    interpreter = _ReferenceModelInterpreter(graph_module)
    with torch.no_grad():
        out = interpreter.run(*inputs)
    if interpreter.delegates_run == 0:
        raise RuntimeError("the program has no TOSA delegate: nothing ran on the reference model")
    outputs = [out] if isinstance(out, torch.Tensor) else list(out)
    # snapshots: an output may alias a buffer that the next call writes in place
    return TosaResult(outputs=[o.clone() for o in outputs], codes=interpreter.codes)


@dataclass
class TosaProgram:
    edge: EdgeProgramManager
    profile: str
    # upstream's to_executorch() rewrites the edge program in place (out-variants,
    # and a copy_ for a written buffer, after which it no longer unlifts); runs use
    # a copy taken at lowering time unless the edge program was replaced since
    _lowered: ExportedProgram | None = field(default=None, init=False, repr=False, compare=False)
    _lowered_copy: ExportedProgram | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self._lowered = self.edge.exported_program()
        self._lowered_copy = copy.deepcopy(self._lowered)

    @property
    def _runnable(self) -> ExportedProgram:
        live = self.edge.exported_program()
        return self._lowered_copy if live is self._lowered else live

    @property
    def exported_program(self) -> ExportedProgram:
        return self.edge.exported_program()

    @property
    def tosa_graphs(self) -> list[bytes]:
        return [m.processed_bytes for m in lowered_modules(self.exported_program)]

    def run(self, *inputs: torch.Tensor) -> TosaResult:
        return _run_once(self._runnable.module(check_guards=False), inputs)

    def operator_counts(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for graph in self.tosa_graphs:
            total += tosa_operator_counts(graph)
        return total

    def delegates(self) -> int:
        return delegate_count(self.exported_program)

    def ops_outside(self) -> Counter[str]:
        return ops_outside_delegates(self.exported_program)


def run_carried(
    program: TosaProgram,
    steps: Iterable[tuple[torch.Tensor, ...]],
    *,
    buffers: dict[str, torch.Tensor] | None = None,
) -> list[TosaResult]:
    """Run consecutive calls on one instance of the lowered program, so buffer writes carry over.

    Each buffer starts from a private copy (the program's own value, or
    `buffers[name]` when given), so neither the program nor a module sharing its
    tensors is written. Returns one result per step.
    """
    graph_module = program._runnable.module(check_guards=False)
    overrides = dict(buffers or {})
    for name, value in list(graph_module.named_buffers()):
        *path, leaf = name.split(".")
        owner = graph_module.get_submodule(".".join(path)) if path else graph_module
        start = overrides.pop(name, value)
        owner.register_buffer(leaf, start.detach().clone().to(value.dtype))
    if overrides:
        raise KeyError(f"the lowered program has no buffers {sorted(overrides)}")
    results = []
    for inputs in steps:
        results.append(_run_once(graph_module, inputs))
    return results


def is_stock_arm_lowering(lower: Callable) -> bool:
    """Upstream's entry point with no etfold fold registered in Arm's pass manager."""
    from etfold.backends.arm import are_arm_folds_registered

    return lower is upstream_to_edge_transform_and_lower and not are_arm_folds_registered()


def lower_tosa(
    program: ExportedProgram,
    profile: str = INT,
    *,
    lower: Callable[..., EdgeProgramManager] = upstream_to_edge_transform_and_lower,
    compile_config=None,
) -> TosaProgram:
    from executorch.backends.arm.tosa.partitioner import TOSAPartitioner

    with lowering_speedups(stock=is_stock_arm_lowering(lower)):
        edge = lower(
            program,
            partitioner=[TOSAPartitioner(compile_spec(profile))],
            compile_config=compile_config,
        )
    return TosaProgram(edge, profile)


def lower_module_tosa(
    module: torch.nn.Module,
    inputs: tuple,
    profile: str = INT,
    *,
    calibration: Iterable[tuple] = (),
    **lower_kwargs,
) -> tuple[TosaProgram, list[torch.Tensor]]:
    """Quantize (INT) or export (FP) `module`, lower it, and return it with eager outputs.

    The eager reference comes from a deep copy taken before lowering: stock Arm
    lowering can write into the user's module.
    """
    module = in_eval_mode(module)
    with torch.no_grad():
        out = copy.deepcopy(module)(*inputs)
    reference = [out] if isinstance(out, torch.Tensor) else list(out)
    if profile == INT:
        program = quantize_for_tosa(module, inputs, calibration=calibration, profile=profile)
    else:
        program = torch.export.export(module, inputs)
    return lower_tosa(program, profile, **lower_kwargs), reference


def max_code_difference(actual: TosaResult, expected: TosaResult) -> int:
    """The largest |difference| between two runs' integer delegate codes, in LSB.

    Both runs must have produced the same number of delegate outputs with the
    same shapes and integer dtypes; anything else raises AssertionError.
    """
    for code in (*actual.codes, *expected.codes):
        if code.dtype.is_floating_point or code.dtype.is_complex:
            raise AssertionError(f"codes are {code.dtype}, not integers: compare outputs instead")
    return int(max_abs_error(actual.codes, expected.codes))


def output_scales(program: TosaProgram) -> list[float | None]:
    """Per program output: the scale of the dequantize producing it (one LSB), if any."""
    graph = program.exported_program.graph
    scales: list[float | None] = []
    for node in graph.output_node().args[0]:
        is_dequant = node.op == "call_function" and "dequantize_per_tensor" in str(node.target)
        scales.append(float(node.args[1]) if is_dequant else None)
    return scales
