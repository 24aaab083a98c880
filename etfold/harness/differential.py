# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Lower one generated case with stock ExecuTorch and with etfold, run both, judge.

`run_case(case)` returns an `Outcome` whose verdict is one of:

- ok: etfold's program matches the reference (and every other oracle holds)
- wrong: etfold's program computes a wrong result where the baseline does not,
  folded what a guard must decline, or (TOSA) differs from the unfolded lowering
  of the same quantized program where its folds claim exactness
- crash_etfold: etfold raised where the baseline lowered and ran
- crash_both: the baseline raised too (an upstream failure, see KNOWN_UPSTREAM)
- upstream_wrong: the baseline is as wrong as etfold (an upstream bug)
- stock_wrong: the baseline's program is wrong and etfold's is right; delegate
  counts are not compared against a wrong program
- mutation: etfold wrote into the user's module or ExportedProgram
  (`etfold.harness.mutation_check`)
- more_delegates: etfold's program has more delegates than the baseline's and no
  fewer ops outside them (XNNPACK; for TOSA, more delegates)

Oracles:
- XNNPACK (weight fold, converts): the baseline is upstream's
  `to_edge_transform_and_lower` with upstream's `XnnpackPartitioner`. Outputs are
  compared with eager at a tolerance for the narrowest dtype in the case, over
  every call of the case's schedule on one loaded program (buffers carry over).
- Arm (scalar-mul, DyT): the baseline is the lowering with etfold's folds not
  registered (for scalar-mul also upstream's own fold retired: it is the unguarded
  one etfold replaces). INT outputs may differ from fp32 eager by no more than the
  baseline's error plus one output LSB; FP outputs must match eager. For DyT the
  integer folds are also checked code for code against the unfolded lowering of
  the very same quantized program.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.export import ExportedProgram

from etfold.decisions import collect_decisions
from etfold.harness import generated
from etfold.harness.generated_cases import DTYPES, Built
from etfold.harness.generated_converts import ConvertsCase
from etfold.harness.generated_dyt import DyTCase
from etfold.harness.generated_scalar_mul import NON_FINITE_SCALES, ScalarMulCase
from etfold.harness.generated_weight_fold import WeightFoldCase
from etfold.harness.mutation_check import changes, snapshot
from etfold.harness.xnnpack_runner import max_abs_error

VERDICTS = (
    "ok",
    "wrong",
    "crash_etfold",
    "crash_both",
    "upstream_wrong",
    "stock_wrong",
    "mutation",
    "more_delegates",
)
FAILURES = ("wrong", "crash_etfold", "mutation", "more_delegates")

# Relative tolerance against eager, by the narrowest dtype a case computes in.
XNNPACK_TOLERANCE = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}
FP_TOSA_TOLERANCE = 1e-4

# Failures of stock ExecuTorch itself (the baseline fails the same way): the
# upstream error each pattern matches, and what the case looks like.
KNOWN_UPSTREAM: tuple[tuple[str, str], ...] = (
    (
        r"leaf Variable that requires grad is being used in an in-place operation",
        "to_executorch of a program that updates a buffer in place",
    ),
    (r"CONST_SHAPE", "TOSA lowering: InternalError on tosa.CONST_SHAPE"),
    (
        r"is not in Core ATen opset",
        "to_edge: an op outside Core ATen (linalg_householder_product from orthogonal(householder))",
    ),
    (
        r"is already in the inputs\. This is likely due to pass through arguments",
        "XNNPACK preprocess: a delegate returning one value twice, or its own input (copies it"
        " drops inside a delegate: a layout-only copy of an input, a returned buffer update)",
    ),
    (
        r"Failed to load method \w+, error: 0x:?1$",
        "XNNPACK runtime rejects the delegate at init (a bf16 BMM: xnn_status_invalid_parameter)",
    ),
    (
        r"malformed TOSA graph, not run: CONV2D reads",
        "Arm lowering drops the layout transpose in front of a conv fed by"
        " permute -> mul by a rank-1 parameter -> permute back (the reference model segfaults on it)",
    ),
    (
        r"Failed to map a given dim_order: \[0, 2, 1, 3\]",
        "fp16 channels-last convs over size-1 channel and width dims: a dim order that names"
        " no memory format",
    ),
    (
        r"method->execute\(\) failed with error 0x12$",
        "portable _to_dim_order_copy rejects a channels-last copy over a size-1 channel dim"
        " (its dim order check; InvalidArgument)",
    ),
    (
        r"method->execute\(\) failed with error 0x10$",
        "XNNPACK runtime: a delegate output over a size-1 channel dim cannot be resized to the"
        " shape it computes (its static output tensor is laid out for another dim order)",
    ),
    (
        r"running the 'Conv1dUnsqueezePass' pass",
        "XNNPACK: Conv1dUnsqueezePass on a conv1d whose weight another conv1d also reads",
    ),
    (
        r"marked not to be transformed before annotation",
        "Arm: conv_transpose1d sites are not transformed before annotation",
    ),
)


def known_pending(case, outcome: Outcome) -> str | None:
    """A failure of a class reported and awaiting its fix, not yet a regression.

    Each entry names the class; remove it with the fix, so the class fails again.
    """
    return None  # every class found so far is fixed


@dataclass
class Outcome:
    family: str
    verdict: str
    detail: str = ""
    etfold_error: float | None = None
    baseline_error: float | None = None
    tolerance: float | None = None
    decisions: list[str] = field(default_factory=list)
    journal: list = field(default_factory=list, repr=False)  # the FoldDecisions themselves
    etfold_failure: str | None = None  # etfold's own error, when it raised
    lowered: object = field(default=None, repr=False)  # etfold's lowered program
    quantized: ExportedProgram | None = field(default=None, repr=False)  # Arm: what it lowered

    @property
    def failed(self) -> bool:
        return self.verdict in FAILURES


def known_upstream(message: str) -> str | None:
    """The KNOWN_UPSTREAM description a baseline error matches, if any."""
    for pattern, description in KNOWN_UPSTREAM:
        if re.search(pattern, message):
            return description
    return None


def _first_line(error: BaseException) -> str:
    """The error's type and the first non-empty line of its message."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


@dataclass
class _Attempt:
    outputs: list[list[torch.Tensor]] | None = None  # per call
    error: BaseException | None = None
    delegates: int = 0
    ops_outside: int = 0  # XNNPACK: ops left outside delegates, over the methods
    lsb: list[float | None] = field(default_factory=list)  # TOSA INT: per user output
    program: object = None
    quantized: ExportedProgram | None = None  # Arm: the program as lowered, before lowering


def _attempt(fn: Callable[[], _Attempt]) -> _Attempt:
    try:
        return fn()
    except Exception as error:  # a crash is a verdict, not a test error
        return _Attempt(error=error)


def eager_rollout(built: Built) -> list[list[torch.Tensor]]:
    """Every call of the schedule on one private copy of the module."""
    module = copy.deepcopy(built.module)
    return _rollout(built, lambda method, inputs: getattr(module, method)(*inputs))


def _rollout(
    built: Built,
    call: Callable[[str, tuple], object],
    forced: list[list[torch.Tensor]] | None = None,
) -> list[list[torch.Tensor]]:
    """Every call of the schedule; with feedback, each call's state input is the
    previous call's state output, that of `forced` (the eager rollout) when given.

    Forcing measures each step's own error: a free-running quantized loop
    amplifies the first step's rounding through the state, for any two
    lowerings that round differently (drift is measured by bench/bench_arm_npu.py).
    """
    results, previous = [], None
    with torch.no_grad():
        for index, step in enumerate(built.calls):
            inputs = list(step.inputs)
            if built.feedback is not None and index > 0:
                out_index, in_index = built.feedback
                source = forced[index - 1] if forced is not None else previous
                inputs[in_index] = source[out_index]
            out = call(step.method, tuple(inputs))
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            outs = [o.detach().clone() for o in outs]
            results.append(outs)
            previous = outs
    return results


def _worst(actual: list[list[torch.Tensor]], expected: list[list[torch.Tensor]]) -> float:
    return max(max_abs_error(a, e) for a, e in zip(actual, expected, strict=True))


def _scale(expected: list[list[torch.Tensor]]) -> float:
    finite = [o.double().abs()[o.isfinite()] for outs in expected for o in outs]
    peaks = [float(f.max()) for f in finite if f.numel()]
    return max([1.0, *peaks])


# ---------------------------------------------------------------- XNNPACK


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


def _executorch_config(built: Built):
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


def _lower_xnnpack(built: Built, programs, partitioner, lower) -> _Attempt:
    from etfold.harness.xnnpack_runner import lower_xnnpack

    lowered = lower_xnnpack(
        programs, [partitioner], lower=lower, executorch_config=_executorch_config(built)
    )
    outputs = _rollout(built, lambda method, inputs: lowered.run(*inputs, method=method))
    delegates = sum(lowered.delegates(m) for m in built.methods)
    outside = sum(sum(lowered.ops_outside(m).values()) for m in built.methods)
    return _Attempt(outputs, delegates=delegates, ops_outside=outside, program=lowered)


Prepare = Callable[[ExportedProgram], None]


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
    expected = _attempt_eager(built)
    built = _calibrated_on_the_rollout(built, expected)

    def stock() -> _Attempt:
        copied = copy.deepcopy(built.module)
        programs = _prepared(_export(built, copied, dynamic_shapes), prepare)
        return _lower_xnnpack(built, programs, UpstreamXnnpackPartitioner(**kwargs), upstream_lower)

    baseline = _attempt(stock)
    programs = _attempt_value(lambda: _prepared(_export(built, None, dynamic_shapes), prepare))
    if isinstance(programs, BaseException):
        return _export_failed(family, programs, baseline)
    programs_before = {m: snapshot(p) for m, p in programs.items()}
    with collect_decisions() as journal:
        ours = _attempt(
            lambda: _lower_xnnpack(
                built, programs, XnnpackPartitioner(**kwargs), to_edge_transform_and_lower
            )
        )
    outcome = Outcome(family, "ok", decisions=[_decision(d) for d in journal])
    outcome.journal = list(journal)
    mutated = changes(module_before, built.module) + [
        f"{m}:{name}" for m, p in programs.items() for name in changes(programs_before[m], p)
    ]
    if mutated:
        return _with(outcome, "mutation", f"etfold changed {mutated[:5]}")
    tolerance = XNNPACK_TOLERANCE[dtype] * _scale(expected or baseline.outputs or [])
    return _judge(outcome, ours, baseline, expected, tolerance)


def _attempt_value(fn):
    try:
        return fn()
    except Exception as error:
        return error


def _attempt_eager(built: Built) -> list[list[torch.Tensor]] | None:
    """The eager rollout, or None when the model itself fails in eager."""
    try:
        return eager_rollout(built)
    except Exception:
        return None


def _export_failed(family: str, error: BaseException, baseline: _Attempt) -> Outcome:
    """torch.export failed before any entry point ran: the same for stock and etfold."""
    verdict = "crash_both" if baseline.error is not None else "crash_etfold"
    return Outcome(family, verdict, _first_line(error))


def run_xnnpack_case(case: WeightFoldCase | ConvertsCase) -> Outcome:
    return differential_xnnpack(
        generated.build(case),
        family=case.family,
        partitioner_kwargs=_partitioner_kwargs(case),
        dtype=_narrowest_dtype(case),
    )


def _decision(d) -> str:
    return f"{d.fold}:{'applied' if d.applied else 'declined'}:{d.where}:{d.detail}"[:200]


def _with(outcome: Outcome, verdict: str, detail: str) -> Outcome:
    outcome.verdict, outcome.detail = verdict, detail
    return outcome


def _judge(
    outcome: Outcome,
    ours: _Attempt,
    baseline: _Attempt,
    expected: list[list[torch.Tensor]] | None,
    tolerance: float,
) -> Outcome:
    """Crashes first, then delegates, then numbers against eager and the baseline."""
    outcome.tolerance = tolerance
    if ours.error is not None:
        outcome.etfold_failure = _first_line(ours.error)
        if baseline.error is not None:
            return _with(outcome, "crash_both", _first_line(baseline.error))
        return _with(outcome, "crash_etfold", _first_line(ours.error))
    if expected is None:  # the model fails in eager: judge etfold against stock's program
        if baseline.error is not None:
            return outcome
        expected = baseline.outputs
    outcome.etfold_error = _error_or_inf(ours.outputs, expected)
    if baseline.error is None:
        outcome.baseline_error = _error_or_inf(baseline.outputs, expected)
    if outcome.etfold_error > tolerance:
        base = outcome.baseline_error
        if base is not None and base > tolerance and outcome.etfold_error <= 2 * base + tolerance:
            return _with(outcome, "upstream_wrong", f"baseline error {base:.3g}")
        return _with(
            outcome,
            "wrong",
            f"error {outcome.etfold_error:.3g} > tolerance {tolerance:.3g} (baseline {base})",
        )
    if outcome.baseline_error is not None and outcome.baseline_error > tolerance:
        return _with(outcome, "stock_wrong", f"baseline error {outcome.baseline_error:.3g}")
    if baseline.error is None and _fragments(ours, baseline):
        return _with(
            outcome,
            "more_delegates",
            f"{ours.delegates} > {baseline.delegates} delegates,"
            f" {ours.ops_outside} ops outside (baseline {baseline.ops_outside})",
        )
    return outcome


def _fragments(ours: _Attempt, baseline: _Attempt) -> bool:
    """More delegates than the baseline without taking any op off the portable path:
    the same work split into more delegate calls."""
    return ours.delegates > baseline.delegates and ours.ops_outside >= baseline.ops_outside


def _error_or_inf(actual, expected) -> float:
    """The worst error over a rollout; a structural mismatch counts as infinitely wrong."""
    try:
        return _worst(actual, expected)
    except AssertionError:
        return float("inf")


# ---------------------------------------------------------------- Arm / TOSA


def _arm_baseline(case) -> Callable:
    """Scalar-mul: stock with its own (unguarded) fold retired; otherwise stock as shipped."""
    from etfold.backends.arm.registration import upstream_folds_retired

    return upstream_folds_retired if isinstance(case, ScalarMulCase) else contextlib.nullcontext


def _profile(case) -> str:
    from etfold.harness.tosa_runner import FP, INT

    return FP if getattr(case, "profile", "INT") == "FP" else INT


def _quantized_or_exported(
    module, built: Built, profile: str, prepare: Prepare | None = None, dynamic_shapes=None
) -> ExportedProgram:
    from etfold.backends.arm import mark_carried_state_outputs
    from etfold.harness.tosa_runner import INT, quantize_exported_for_tosa

    inputs = built.calls[0].inputs
    exported = torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes)
    if built.feedback is not None:
        mark_carried_state_outputs(exported, [built.feedback[0]])
    if prepare is not None:
        prepare(exported)
    if profile != INT:
        return exported
    return quantize_exported_for_tosa(exported, inputs, calibration=built.calibration)


def _run_tosa(built: Built, program, forced=None) -> list[list[torch.Tensor]]:
    from etfold.harness.tosa_runner import run_carried

    if built.feedback is None:  # one program instance: buffer writes carry to the next call
        return [list(r.outputs) for r in run_carried(program, [c.inputs for c in built.calls])]
    return _rollout(built, lambda _method, inputs: program.run(*inputs).outputs, forced)


def _lower_arm(
    built: Built,
    profile: str,
    module,
    context,
    prepare: Prepare | None,
    dynamic_shapes=None,
    forced=None,
) -> _Attempt:
    from etfold.harness.tosa_runner import INT, lower_tosa, output_scales

    with context():
        quantized = _quantized_or_exported(module, built, profile, prepare, dynamic_shapes)
        kept = copy.deepcopy(quantized)
        program = lower_tosa(quantized, profile)
    outputs = _run_tosa(built, program, forced)
    users = len(outputs[0])
    lsb = output_scales(program)[-users:] if profile == INT else [None] * users
    return _Attempt(
        outputs, delegates=program.delegates(), lsb=lsb, program=program, quantized=kept
    )


def differential_arm(
    built: Built,
    *,
    family: str = "arm",
    profile: str = "TOSA-1.0+INT",
    baseline_context: Callable = contextlib.nullcontext,
    prepare: Prepare | None = None,
    dynamic_shapes=None,
) -> Outcome:
    """The baseline lowering vs etfold's (`arm_folds_registered`) on the TOSA reference model.

    The baseline lowers a deep copy; etfold lowers the user's module itself, which
    must come back unchanged. `prepare` edits each export before quantization.
    """
    from etfold.backends.arm import arm_folds_registered

    module_before = snapshot(built.module)
    expected = _attempt_eager(built)
    built = _calibrated_on_the_rollout(built, expected)
    copied = copy.deepcopy(built.module)
    baseline = _attempt(
        lambda: _lower_arm(
            built, profile, copied, baseline_context, prepare, dynamic_shapes, expected
        )
    )
    with collect_decisions() as journal:
        ours = _attempt(
            lambda: _lower_arm(
                built,
                profile,
                built.module,
                arm_folds_registered,
                prepare,
                dynamic_shapes,
                expected,
            )
        )
    outcome = Outcome(family, "ok", decisions=[_decision(d) for d in journal])
    outcome.journal, outcome.lowered, outcome.quantized = (
        list(journal),
        ours.program,
        ours.quantized,
    )
    mutated = changes(module_before, built.module)
    if mutated:
        return _with(outcome, "mutation", f"etfold changed {mutated[:5]}")
    int_profile = profile.endswith("INT")
    if ours.error is None and baseline.error is None and int_profile and expected is not None:
        return _judge_int(outcome, ours, baseline, expected)
    tolerance = FP_TOSA_TOLERANCE * _scale(expected or baseline.outputs or [])
    return _judge(outcome, ours, baseline, expected, tolerance)


def _calibrated_on_the_rollout(built: Built, expected) -> Built:
    """With feedback, calibrate on the states the calls will get too: a state outside
    the calibrated range saturates both lowerings, each in its own way."""
    if built.feedback is None or expected is None:
        return built
    out_index, in_index = built.feedback
    states = []
    for index, call in enumerate(built.calls[1:], start=1):
        inputs = list(call.inputs)
        inputs[in_index] = expected[index - 1][out_index]
        states.append(tuple(inputs))
    return dataclasses.replace(built, calibration=[*built.calibration, *states])


def run_arm_case(case: ScalarMulCase | DyTCase) -> Outcome:
    built = generated.build(case)
    outcome = differential_arm(
        built, family=case.family, profile=_profile(case), baseline_context=_arm_baseline(case)
    )
    guard = _guard_violation(case, outcome.journal)
    if guard:
        return _with(outcome, "wrong", guard)
    if isinstance(case, DyTCase) and outcome.verdict == "ok":
        mismatch = codes_match_unfolded(built, outcome)
        if mismatch:
            return _with(outcome, "wrong", mismatch)
    return outcome


def _guard_violation(case, journal) -> str | None:
    """A scalar-mul fold of a scale that is not a finite constant along channels."""
    if not isinstance(case, ScalarMulCase):
        return None
    must_decline = case.scale_values in NON_FINITE_SCALES or case.scale_kind in (
        "activation",
        "spatial",
    )
    applied = [d for d in journal if d.fold == "arm.scalar_mul_into_conv" and d.applied]
    foldable = 1 if case.share else 0  # the shared-weight branch has a finite per-channel scale
    if must_decline and len(applied) > foldable:
        where = ", ".join(d.where for d in applied)
        return f"folded a {case.scale_kind} {case.scale_values} scale: {where}"
    return None


# INT: within one LSB of the baseline everywhere is right (the oracle the folds promise).
# Farther apart, bounds in output LSB on how much worse than the baseline etfold may be
# against eager: an annotation-time fold changes which values are observed and rounded,
# so after a nonlinearity single elements can land a few grid steps apart either way; a
# wrong fold (wrong axis, missing bias, stale state) moves whole channels, which the mean shows.
INT_MAX_EXCESS = 3.0  # never more than this, anywhere
INT_LSB = 1.0  # beyond one LSB somewhere, the mean must not be worse ...
INT_MEAN_EXCESS = 0.1  # ... by more than this
INT_SAME_STEP = 1.0 + 1e-3  # one LSB apart, up to fp32 noise in dequantizing


def _int_excess(mine: torch.Tensor, base: torch.Tensor, ref: torch.Tensor, lsb: float):
    """(max, mean) error of `mine` minus that of `base`, against `ref`, in LSB."""
    from etfold.harness.xnnpack_runner import elementwise_error

    _check_same_layout(mine, ref)
    _check_same_layout(base, ref)
    if not ref.numel():
        return 0.0, 0.0
    mine_error, base_error = elementwise_error(mine, ref), elementwise_error(base, ref)
    max_excess = (float(mine_error.max()) - float(base_error.max())) / lsb
    mean_excess = (float(mine_error.mean()) - float(base_error.mean())) / lsb
    return max_excess, mean_excess


def _within_one_step(mine: torch.Tensor, base: torch.Tensor, lsb: float) -> bool:
    """Every element at most one LSB from the baseline's (NaN anywhere is not)."""
    if not base.numel():
        return True
    return bool(((mine - base).abs() <= INT_SAME_STEP * lsb).all())


def _check_same_layout(actual: torch.Tensor, expected: torch.Tensor) -> None:
    max_abs_error([actual], [expected])  # raises on a count, shape or dtype mismatch


def _judge_int(outcome: Outcome, ours: _Attempt, baseline: _Attempt, expected) -> Outcome:
    """Each output over the whole rollout, in LSB of that output: within one LSB of the
    baseline's everywhere, or else, against eager, etfold's max error at most
    INT_MAX_EXCESS above the baseline's and, where it is more than INT_LSB above, its
    mean error at most INT_MEAN_EXCESS above. Then delegates.

    A rollout is judged whole: where an output's own rounding noise is many LSB (a
    fine grid after a coarse input), which step shows the noise's peak is luck, while
    drift from a wrong fold raises the peak and the mean over the steps."""
    for step, (mine, base, ref) in enumerate(
        zip(ours.outputs, baseline.outputs, expected, strict=True)
    ):
        if len(mine) != len(ref) or len(base) != len(ref):
            return _with(outcome, "wrong", f"step {step}: {len(mine)} outputs, eager {len(ref)}")
        for index, (m, b, e) in enumerate(zip(mine, base, ref, strict=True)):
            try:
                _check_same_layout(m, e)
                _check_same_layout(b, e)
            except AssertionError as mismatch:
                return _with(outcome, "wrong", f"step {step} output {index}: {mismatch}")
    outcome.etfold_error = _error_or_inf(ours.outputs, expected)
    outcome.baseline_error = _error_or_inf(baseline.outputs, expected)
    for index in range(len(expected[0]) if expected else 0):
        m, b, e = (
            _over_the_rollout(run, index) for run in (ours.outputs, baseline.outputs, expected)
        )
        lsbs = [s for s in (ours.lsb[index], baseline.lsb[index]) if s is not None]
        lsb = max(lsbs) if lsbs else FP_TOSA_TOLERANCE * _scale([[e]])
        if _within_one_step(m, b, lsb):
            continue
        max_excess, mean_excess = _int_excess(m, b, e, lsb)
        too_far = max_excess > INT_MAX_EXCESS
        if too_far or (max_excess > INT_LSB and mean_excess > INT_MEAN_EXCESS):
            return _with(
                outcome,
                "wrong",
                f"output {index} over {len(expected)} step(s): {max_excess:.2f} LSB worse than"
                f" the baseline at most, {mean_excess:.3f} LSB on average (lsb {lsb:.3g})",
            )
    if ours.delegates > baseline.delegates:
        return _with(outcome, "more_delegates", f"{ours.delegates} > {baseline.delegates}")
    return outcome


def _over_the_rollout(run: list[list[torch.Tensor]], index: int) -> torch.Tensor:
    """Output `index` of every step, flattened into one tensor."""
    return torch.cat([step[index].reshape(-1) for step in run])


def codes_match_unfolded(built: Built, outcome: Outcome) -> str | None:
    """etfold's integer lowering vs the unfolded lowering of the very same quantized program:
    every delegate code equal (the integer DyT folds claim exactness).

    Returns None when they match, else a description.
    """
    from etfold.backends.arm.registration import upstream_folds_retired
    from etfold.harness.tosa_runner import INT, lower_tosa, max_code_difference

    try:
        with upstream_folds_retired():
            unfolded = lower_tosa(copy.deepcopy(outcome.quantized), INT)
    except Exception:
        return None  # nothing to compare with: not etfold's failure
    eager = _attempt_eager(built)
    for step, call in enumerate(built.calls):
        try:
            expected = unfolded.run(*call.inputs)
        except RuntimeError:
            return None  # the unfolded lowering does not run (an upstream bug, KNOWN_UPSTREAM)
        ours = outcome.lowered.run(*call.inputs)
        if eager is not None and _farther_from_eager(expected, ours, eager[step], unfolded):
            return None  # the unfolded lowering is the wrong one (an upstream bug)
        difference = max_code_difference(ours, expected)
        if difference:
            return f"integer folds differ from the unfolded lowering by {difference} LSB"
    return None


def _farther_from_eager(unfolded, ours, eager: list[torch.Tensor], program) -> bool:
    """The unfolded lowering misses eager by more than INT_MAX_EXCESS LSB beyond etfold's miss."""
    from etfold.harness.tosa_runner import output_scales
    from etfold.harness.xnnpack_runner import max_abs_error

    lsbs = [s for s in output_scales(program)[-len(eager) :] if s is not None]
    if not lsbs:
        return False
    excess = max_abs_error(unfolded.outputs, eager) - max_abs_error(ours.outputs, eager)
    return excess > INT_MAX_EXCESS * max(lsbs)


def failure_message(case, outcome: Outcome) -> str | None:
    """None when the outcome is acceptable; else what went wrong, with the case as repro.

    Acceptable: ok; stock alone wrong (stock_wrong); the baseline failing the same
    way (upstream_wrong, or
    crash_both with an error in KNOWN_UPSTREAM); a failure of a class with an
    open fix (`known_pending`). An unknown upstream crash is not acceptable
    until it is listed, so a new upstream failure is looked at once.
    """
    if outcome.verdict in ("ok", "upstream_wrong", "stock_wrong"):
        return None
    if outcome.verdict == "crash_both":
        if known_upstream(outcome.detail):
            return None
        return f"stock and etfold both fail, not in KNOWN_UPSTREAM: {outcome.detail}\n{case!r}"
    if known_pending(case, outcome):
        return None
    return f"{outcome.verdict}: {outcome.detail}\n{case!r}"


def run_case(case) -> Outcome:
    if isinstance(case, WeightFoldCase | ConvertsCase):
        return run_xnnpack_case(case)
    return run_arm_case(case)


def summarize(outcomes: Sequence[Outcome], timeouts: int = 0) -> dict[str, int]:
    counts = {v: 0 for v in VERDICTS}
    for outcome in outcomes:
        counts[outcome.verdict] += 1
    counts["cases"] = len(outcomes) + timeouts
    counts["timeouts"] = timeouts
    return counts
