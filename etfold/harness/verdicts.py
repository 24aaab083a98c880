# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""What a differential run concludes: the verdicts, the float tolerances, the
catalogue of failures stock ExecuTorch shares (KNOWN_UPSTREAM), and the float judge.

The verdicts are listed in `etfold.harness.differential`'s docstring.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.export import ExportedProgram

from etfold.harness.attempts import Attempt, error_or_inf, first_line

VERDICTS = (
    "ok",
    "wrong",
    "crash_etfold",
    "crash_both",
    "crash_stock",
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
        "XNNPACK: Conv1dUnsqueezePass on a conv1d whose weight another conv1d also reads, or on"
        " the two conv1d XNNPACK makes of one BatchNorm1d applied to two rank-2 tensors (etfold"
        " lowers both: shared conv1d weights, and each batch norm's own gamma)",
    ),
    (
        r"marked not to be transformed before annotation",
        "Arm: conv_transpose1d sites are not transformed before annotation",
    ),
    # upstream_folds: stock's wrong programs, by the hazards the case names
    (
        r"stock wrong: \w+ \+ bn\b.*share=(weight|bias|three|weight_and_bias),",
        "conv/linear + batch norm, layers sharing a weight or bias: XNNPACK's FuseBatchNormPass,"
        " Arm's FuseBatchNorm2dPass and torchao's prepare_pt2e fusion give every sharer one"
        " layer's fused constant; etfold gives each fused layer constants of its own first"
        " (own_constants_before_batch_norm_fusion) and is right",
    ),
    (
        r"running the 'DecomposeBatchNorm' pass",
        "XNNPACK DecomposeBatchNorm: a batch norm reading a batch norm it decomposed first (the"
        " conv it made has no fake value: KeyError 'val'; bn(bn(relu(x)))); etfold crashes the"
        " same way",
    ),
    (
        r"running the '_ExportedProgramGraphPassAdapter' pass",
        "TOSA FP, Arm pass pipeline: FuseBatchNorm2dPass on a batch norm reading a batch norm it"
        " fused or replaced first (KeyError 'val'; bn(bn(relu(x)))), or linear + BatchNorm1d on"
        " a rank-2 input; etfold crashes the same way on the first (the pattern names only the"
        " adapter, so it covers any Arm pass failure: read the case)",
    ),
    (
        r"the program has no TOSA delegate",
        "TOSA FP: a conv_transpose1d whose output nothing else reads is not delegated, so"
        " nothing runs on the reference model (stock and etfold alike)",
    ),
)


def known_pending(case, outcome: Outcome) -> str | None:
    """A failure of a class reported and awaiting its fix, not yet a regression.

    Each entry names the class; remove it with the fix, so the class fails again.
    """
    return None


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
    baseline_failure: str | None = None  # the baseline's error, when it raised
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


def decision_text(d) -> str:
    return f"{d.fold}:{'applied' if d.applied else 'declined'}:{d.where}:{d.detail}"[:200]


def with_verdict(outcome: Outcome, verdict: str, detail: str) -> Outcome:
    outcome.verdict, outcome.detail = verdict, detail
    return outcome


def export_failed(family: str, error: BaseException, baseline: Attempt) -> Outcome:
    """torch.export failed before any entry point ran: the same for stock and etfold."""
    verdict = "crash_both" if baseline.error is not None else "crash_etfold"
    return Outcome(family, verdict, first_line(error))


def judge_floats(
    outcome: Outcome,
    ours: Attempt,
    baseline: Attempt,
    expected: list[list[torch.Tensor]] | None,
    tolerance: float,
) -> Outcome:
    """Crashes first, then delegates, then numbers against eager and the baseline."""
    outcome.tolerance = tolerance
    if baseline.error is not None:
        outcome.baseline_failure = first_line(baseline.error)
    if ours.error is not None:
        outcome.etfold_failure = first_line(ours.error)
        if baseline.error is not None:
            return with_verdict(outcome, "crash_both", first_line(baseline.error))
        return with_verdict(outcome, "crash_etfold", first_line(ours.error))
    if expected is None:  # the model fails in eager: judge etfold against stock's program
        if baseline.error is not None:
            return outcome
        expected = baseline.outputs
    outcome.etfold_error = error_or_inf(ours.outputs, expected)
    if baseline.error is None:
        outcome.baseline_error = error_or_inf(baseline.outputs, expected)
    if outcome.etfold_error > tolerance:
        base = outcome.baseline_error
        if base is not None and base > tolerance and outcome.etfold_error <= 2 * base + tolerance:
            return with_verdict(outcome, "upstream_wrong", f"baseline error {base:.3g}")
        return with_verdict(
            outcome,
            "wrong",
            f"error {outcome.etfold_error:.3g} > tolerance {tolerance:.3g} (baseline {base})",
        )
    if outcome.baseline_error is not None and outcome.baseline_error > tolerance:
        return with_verdict(outcome, "stock_wrong", f"baseline error {outcome.baseline_error:.3g}")
    if baseline.error is None and _fragments(ours, baseline):
        return with_verdict(
            outcome,
            "more_delegates",
            f"{ours.delegates} > {baseline.delegates} delegates,"
            f" {ours.ops_outside} ops outside (baseline {baseline.ops_outside})",
        )
    return outcome


def _fragments(ours: Attempt, baseline: Attempt) -> bool:
    """More delegates than the baseline without taking any op off the portable path:
    the same work split into more delegate calls."""
    return ours.delegates > baseline.delegates and ours.ops_outside >= baseline.ops_outside


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
    if outcome.verdict in ("crash_both", "crash_stock"):
        if known_upstream(outcome.detail):
            return None
        who = "stock and etfold both fail" if outcome.verdict == "crash_both" else "stock fails"
        return f"{who}, not in KNOWN_UPSTREAM: {outcome.detail}\n{case!r}"
    if known_pending(case, outcome):
        return None
    return f"{outcome.verdict}: {outcome.detail}\n{case!r}"


def summarize(outcomes: Sequence[Outcome], timeouts: int = 0) -> dict[str, int]:
    counts = {v: 0 for v in VERDICTS}
    for outcome in outcomes:
        counts[outcome.verdict] += 1
    counts["cases"] = len(outcomes) + timeouts
    counts["timeouts"] = timeouts
    return counts
