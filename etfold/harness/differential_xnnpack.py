# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Stock vs etfold on the XNNPACK runtime for one case: upstream's entry point with
upstream's partitioner against etfold's, both against eager over the case's rollout.
"""

from __future__ import annotations

import copy

import torch
from torch.export import ExportedProgram

from etfold.decisions import collect_decisions
from etfold.harness import generated
from etfold.harness.attempts import (
    Attempt,
    Prepare,
    attempt,
    attempt_eager,
    attempt_value,
    calibrated_on_the_rollout,
    output_scale,
    rollout,
)
from etfold.harness.generated_cases import DTYPES, Built
from etfold.harness.generated_converts import ConvertsCase
from etfold.harness.generated_weight_fold import WeightFoldCase
from etfold.harness.mutation_check import changes, snapshot
from etfold.harness.verdicts import (
    XNNPACK_TOLERANCE,
    Outcome,
    decision_text,
    export_failed,
    judge_floats,
    with_verdict,
)


def _narrowest_dtype(case) -> torch.dtype:
    if isinstance(case, WeightFoldCase):
        names = [case.dtype]
    else:
        names = [case.model_dtype, *(r.dtype for r in case.regions)]
    dtypes = [DTYPES[n] for n in names]
    return max(dtypes, key=lambda d: XNNPACK_TOLERANCE[d])


def _partitioner_kwargs(case) -> dict:
    uses_bf16 = _narrowest_dtype(case) is torch.bfloat16 or isinstance(case, ConvertsCase)
    return {"enable_bf16": True} if uses_bf16 else {}


def executorch_config(built: Built):
    """Serialize every buffer's initial value, and share buffers between methods.

    ExecuTorch serializes only the shape of a buffer the program writes, unless the
    buffer is marked `et_init_buffer`; eager starts from the registered value, so the
    oracle marks them all. Methods share mutable buffers, so a buffer one method
    writes is what another reads.
    """
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

    buffers = [name.replace(".", "_") for name, _ in built.module.named_buffers()]
    initialized = [InitializedMutableBufferPass(buffers)] if buffers else []
    if len(built.methods) == 1:
        return ExecutorchBackendConfig(passes=initialized) if initialized else None
    return ExecutorchBackendConfig(
        passes=initialized,
        memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True),
        emit_mutable_buffer_names=True,
    )


def _lower_xnnpack(built: Built, programs, partitioner, lower) -> Attempt:
    from etfold.harness.xnnpack_runner import lower_xnnpack

    lowered = lower_xnnpack(
        programs, [partitioner], lower=lower, executorch_config=executorch_config(built)
    )
    outputs = rollout(built, lambda method, inputs: lowered.run(*inputs, method=method))
    delegates = sum(lowered.delegates(m) for m in built.methods)
    outside = sum(sum(lowered.ops_outside(m).values()) for m in built.methods)
    return Attempt(outputs, delegates=delegates, ops_outside=outside, program=lowered)


def _export(built: Built, module=None, dynamic_shapes=None) -> dict[str, ExportedProgram]:
    from etfold.harness.xnnpack_runner import export_method

    module = built.module if module is None else module
    if dynamic_shapes is not None:
        (inputs,) = built.methods.values()
        return {"forward": torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes)}
    return {m: export_method(module, m, inputs) for m, inputs in built.methods.items()}


def _prepared(programs: dict[str, ExportedProgram], prepare: Prepare | None):
    for program in programs.values():
        if prepare is not None:
            prepare(program)
    return programs


def differential_xnnpack(
    built: Built,
    *,
    family: str = "xnnpack",
    partitioner_kwargs: dict | None = None,
    dtype: torch.dtype = torch.float32,
    prepare: Prepare | None = None,
    dynamic_shapes=None,
) -> Outcome:
    """Stock vs etfold on XNNPACK for one built model. `prepare` edits each fresh export
    (the same way for both lowerings) before it is lowered."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
        XnnpackPartitioner as UpstreamXnnpackPartitioner,
    )
    from executorch.exir import to_edge_transform_and_lower as upstream_lower

    from etfold.backends.xnnpack import XnnpackPartitioner
    from etfold.exir import to_edge_transform_and_lower

    kwargs = partitioner_kwargs or {}
    module_before = snapshot(built.module)
    expected = attempt_eager(built)
    built = calibrated_on_the_rollout(built, expected)

    def stock() -> Attempt:
        copied = copy.deepcopy(built.module)
        programs = _prepared(_export(built, copied, dynamic_shapes), prepare)
        return _lower_xnnpack(built, programs, UpstreamXnnpackPartitioner(**kwargs), upstream_lower)

    baseline = attempt(stock)
    programs = attempt_value(lambda: _prepared(_export(built, None, dynamic_shapes), prepare))
    if isinstance(programs, BaseException):
        return export_failed(family, programs, baseline)
    programs_before = {m: snapshot(p) for m, p in programs.items()}
    with collect_decisions() as journal:
        ours = attempt(
            lambda: _lower_xnnpack(
                built, programs, XnnpackPartitioner(**kwargs), to_edge_transform_and_lower
            )
        )
    outcome = Outcome(family, "ok", decisions=[decision_text(d) for d in journal])
    outcome.journal = list(journal)
    mutated = changes(module_before, built.module) + [
        f"{m}:{name}" for m, p in programs.items() for name in changes(programs_before[m], p)
    ]
    if mutated:
        return with_verdict(outcome, "mutation", f"etfold changed {mutated[:5]}")
    tolerance = XNNPACK_TOLERANCE[dtype] * output_scale(expected or baseline.outputs or [])
    return judge_floats(outcome, ours, baseline, expected, tolerance)


def run_xnnpack_case(case: WeightFoldCase | ConvertsCase) -> Outcome:
    return differential_xnnpack(
        generated.build(case),
        family=case.family,
        partitioner_kwargs=_partitioner_kwargs(case),
        dtype=_narrowest_dtype(case),
    )
