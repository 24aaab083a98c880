# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Lower for an Ethos-U NPU through ExecuTorch's own path and read Vela's estimate.

`lower_module_ethos_u(module, inputs, "ethos-u55-128")` quantizes with upstream's
`EthosUQuantizer` (its annotation pipeline sees the Ethos-U TOSA spec, as a
user's would), lowers with `EthosUPartitioner`, and returns the lowered program
with one `VelaEstimate` per delegate, read from the summary Vela writes beside
the command stream it compiles, with Vela's per-layer cycles (`layers`, from
its `--verbose-performance` report). Vela's stdout goes into the estimate's `log`.

Upstream compiles each delegate with `executorch.backends.arm.ethosu.backend.
vela_compile`; while a lowering runs here, that name is wrapped so each call
gets a private output directory (upstream reuses one), and restored after.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import dataclasses
import io
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from executorch.exir import EdgeProgramManager
from executorch.exir import to_edge_transform_and_lower as upstream_to_edge_transform_and_lower
from torch.export import ExportedProgram

from etfold.harness.inspection import lowered_modules, tosa_operator_counts
from etfold.harness.lowering_speedups import lowering_speedups
from etfold.harness.modules import in_eval_mode

U55 = "ethos-u55-128"
U85 = "ethos-u85-256"
TARGETS = (U55, U85)

_BACKEND_MODULE = "executorch.backends.arm.ethosu.backend"


@dataclass(frozen=True)
class VelaLayer:
    """One operator Vela scheduled, from its per-layer report."""

    operator: str  # the TOSA operator it comes from ("Rescale", "TransposeConv2D", ...)
    npu_operator: str  # what Vela runs it as ("Mul", "Conv2D", ...)
    name: str  # Vela's name for it (a TOSA tensor name; differs between lowerings)
    cycles: int


def read_per_layer(path: Path) -> tuple[VelaLayer, ...]:
    """The layers in a Vela `*_per-layer.csv`, in schedule order."""
    with path.open(newline="") as handle:
        return tuple(
            VelaLayer(
                row["Original Operator"],
                row["NNG Operator"],
                row["Name"],
                int(round(float(row["Op Cycles"]))),
            )
            for row in csv.DictReader(handle)
        )


@dataclass(frozen=True)
class VelaEstimate:
    """Vela's performance and memory estimate for one compiled delegate (or a sum)."""

    total_cycles: int
    npu_cycles: int
    sram_bytes: int  # peak SRAM used
    flash_bytes: int  # on- and off-chip flash used (read-only weights and constants)
    encoded_weight_bytes: int
    tosa_operators: Counter[str] = field(default_factory=Counter, compare=False, repr=False)
    log: str = field(default="", compare=False, repr=False)
    layers: tuple[VelaLayer, ...] = field(default=(), compare=False, repr=False)

    def __add__(self, other: VelaEstimate) -> VelaEstimate:
        return VelaEstimate(
            self.total_cycles + other.total_cycles,
            self.npu_cycles + other.npu_cycles,
            max(self.sram_bytes, other.sram_bytes),
            self.flash_bytes + other.flash_bytes,
            self.encoded_weight_bytes + other.encoded_weight_bytes,
            self.tosa_operators + other.tosa_operators,
            self.log + other.log,
            self.layers + other.layers,
        )


def _number(row: dict[str, str], key: str, unit: int = 1) -> int:
    value = row.get(key) or "0"
    return int(round(float(value) * unit))


def read_summary(path: Path) -> VelaEstimate:
    """The estimate in a Vela `*_summary_*.csv` (one data row)."""
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    if len(rows) != 1:
        raise RuntimeError(f"{path}: expected one summary row, found {len(rows)}")
    row = rows[0]
    return VelaEstimate(
        total_cycles=_number(row, "cycles_total"),
        npu_cycles=_number(row, "cycles_npu"),
        # Vela reports memory in KiB
        sram_bytes=_number(row, "sram_memory_used", 1024),
        flash_bytes=_number(row, "on_chip_flash_memory_used", 1024)
        + _number(row, "off_chip_flash_memory_used", 1024),
        encoded_weight_bytes=_number(row, "total_npu_encoded_weights"),
    )


@contextlib.contextmanager
def _estimates_collected() -> Iterator[list[VelaEstimate]]:
    """Wrap upstream's per-delegate Vela call for the block; collect each estimate."""
    import importlib

    backend = importlib.import_module(_BACKEND_MODULE)
    original = backend.vela_compile
    estimates: list[VelaEstimate] = []

    def vela_compile(tosa_flatbuffer, args, verbose=False, intermediate_path=None, **kwargs):
        with tempfile.TemporaryDirectory(prefix="etfold_vela_") as directory:
            stdout = io.StringIO()
            with contextlib.redirect_stdout(stdout):
                result = original(
                    tosa_flatbuffer,
                    [*args, "--verbose-performance"],
                    False,
                    intermediate_path=directory,
                    **kwargs,
                )
            summaries = sorted(Path(directory, "output").glob("*_summary_*.csv"))
            if len(summaries) != 1:
                raise RuntimeError(f"Vela wrote {len(summaries)} summaries, expected one")
            estimate = read_summary(summaries[0])
            per_layer = sorted(Path(directory, "output").glob("*_per-layer.csv"))
            estimates.append(
                dataclasses.replace(
                    estimate,
                    tosa_operators=tosa_operator_counts(tosa_flatbuffer),
                    log=stdout.getvalue(),
                    layers=read_per_layer(per_layer[0]) if per_layer else (),
                )
            )
        return result

    backend.vela_compile = vela_compile
    try:
        yield estimates
    finally:
        backend.vela_compile = original


def ethos_u_compile_spec(target: str):
    from executorch.backends.arm.ethosu import EthosUCompileSpec

    if target not in TARGETS and not target.startswith("ethos-u"):
        raise ValueError(f"not an Ethos-U target: {target!r} (try one of {TARGETS})")
    return EthosUCompileSpec(target)


def ethos_u_quantizer(target: str):
    """Upstream's EthosUQuantizer, symmetric int8 with per-channel weights."""
    from executorch.backends.arm.quantizer import (
        EthosUQuantizer,
        get_symmetric_quantization_config,
    )

    quantizer = EthosUQuantizer(ethos_u_compile_spec(target))
    quantizer.set_global(get_symmetric_quantization_config(is_per_channel=True))
    return quantizer


def quantize_for_ethos_u(
    module: torch.nn.Module, inputs: tuple, target: str, *, calibration: Iterable[tuple] = ()
) -> ExportedProgram:
    """export → prepare_pt2e (the Ethos-U annotation pipeline) → calibrate → convert → export."""
    from etfold.harness.tosa_runner import quantize_exported

    exported = torch.export.export(in_eval_mode(module), inputs)
    return quantize_exported(exported, ethos_u_quantizer(target), inputs, calibration)


@dataclass
class EthosUProgram:
    edge: EdgeProgramManager
    target: str
    estimates: list[VelaEstimate]  # one per delegate, in compile order

    @property
    def estimate(self) -> VelaEstimate:
        """The whole program: cycles and flash summed over delegates, peak SRAM."""
        if not self.estimates:
            raise RuntimeError("nothing was delegated to the NPU")
        total = self.estimates[0]
        for estimate in self.estimates[1:]:
            total = total + estimate
        return total

    def operator_counts(self) -> Counter[str]:
        """TOSA operators Vela was handed, over all delegates."""
        total: Counter[str] = Counter()
        for estimate in self.estimates:
            total += estimate.tosa_operators
        return total

    def delegates(self) -> int:
        return len(lowered_modules(self.edge.exported_program()))


def lower_ethos_u(
    program: ExportedProgram,
    target: str,
    *,
    lower: Callable[..., EdgeProgramManager] = upstream_to_edge_transform_and_lower,
) -> EthosUProgram:
    """Lower a quantized program with EthosUPartitioner for `target`; collect Vela's estimates.

    The program is deep-copied, so one quantized program can be lowered for
    several targets or with and without etfold's folds.
    """
    from executorch.backends.arm.ethosu import EthosUPartitioner

    partitioner = EthosUPartitioner(ethos_u_compile_spec(target))
    from etfold.harness.tosa_runner import is_stock_arm_lowering

    stock = is_stock_arm_lowering(lower)
    with _estimates_collected() as estimates, lowering_speedups(stock=stock):
        edge = lower(copy.deepcopy(program), partitioner=[partitioner])
    return EthosUProgram(edge, target, list(estimates))


def lower_module_ethos_u(
    module: torch.nn.Module,
    inputs: tuple,
    target: str,
    *,
    calibration: Iterable[tuple] = (),
    **lower_kwargs,
) -> EthosUProgram:
    """Quantize `module` for `target` and lower it for the NPU (a deep copy; the module is read only)."""
    program = quantize_for_ethos_u(copy.deepcopy(module), inputs, target, calibration=calibration)
    return lower_ethos_u(program, target, **lower_kwargs)
