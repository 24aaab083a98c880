# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Programs a user cannot tell apart fold alike on XNNPACK.

Each pair lowers two spellings of one program through
`etfold.exir.to_edge_transform_and_lower` with etfold's `XnnpackPartitioner`
and asserts the same fold decisions (applied, or declined with the same
reason), the same delegates and ops outside them, and the same outputs on the
XNNPACK runtime over several calls of one loaded program (buffers carry):
in-place vs functionalized state (`run_decompositions({})`: write-back outputs),
strict vs non-strict export, and a model vs its deep copy.

What may differ between spellings, and only that:
- node names (`mul` vs `mul_1`), so a decision's `where` is compared where it
  names a parameter (the weight fold's) and in full only between exports of
  one graph (strict, deep copy);
- how a write is named in a decline: the in-place op (`aten.mul_.Tensor`) or
  "a functionalized mutation", which is all the functionalized program knows;
- for a user input written in place, the copies writing it back: upstream's
  lowering writes a functionalized input mutation back with one more
  `aten.copy` than the in-place one (stock ExecuTorch does the same).

One form of each pair is also run against eager. Its written buffers keep their
initial values (`InitializedMutableBufferPass`; by default ExecuTorch serializes
only their shape). The runtime leaves a caller's tensor as it was and returns
the input's new value as the method's first output, so eager is read the same way.
"""

from __future__ import annotations

import copy
import functools
import re
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from executorch.exir import ExecutorchBackendConfig
from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch.nn.utils.parametrizations import weight_norm

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.exir.passes.graph_walk import FUNCTIONALIZED
from etfold.harness.xnnpack_runner import assert_close, lower_xnnpack

# no shrinking: a draw is two lowerings, and every draw names the whole case anyway
PAIRS = settings(
    max_examples=2,
    derandomize=True,
    database=None,
    deadline=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow],
)
WEIGHT_FOLD = "xnnpack.fold_gemm_weight"
# folds whose `where` names a parameter, the same in every spelling
NAMED_BY_PARAMETER = frozenset({WEIGHT_FOLD})
WRITE_BACK_COPY = "aten.copy.default"
CALLS = 3

# ---- the models ----------------------------------------------------------------


class GainState(torch.nn.Module):
    """`linear.weight * gain` is the weight; `forward` writes one buffer in place
    (`add_` or `copy_`), before or after the weight reads `gain`.

    Writing `gain` must keep the weight dynamic; writing `state` must not. What
    `gain` is written with never depends on `x`: functionalized, the weight would
    read that value itself and decline as computed from the input instead."""

    def __init__(self, features: int, written: str, write: str, order: str):
        super().__init__()
        self.written, self.write, self.order = written, write, order
        self.linear = torch.nn.Linear(features, features)
        self.register_buffer("gain", torch.rand(features, 1) + 0.5)
        self.register_buffer("state", torch.zeros(features))

    def _update(self, x):
        if self.written == "gain":
            getattr(self.gain, self.write)(self.gain * 0.5)
        else:
            getattr(self.state, self.write)(x.mean(0))

    def forward(self, x):
        if self.order == "write_first":
            self._update(x)
        weight = self.linear.weight * self.gain
        y = torch.nn.functional.linear(x, weight, self.linear.bias)
        if self.order == "read_first":
            self._update(x)
        return y + self.state


class InputState(torch.nn.Module):
    """The state passed in by the caller and written in place; the weight folds."""

    def __init__(self, features: int):
        super().__init__()
        self.linear = torch.nn.Linear(features, features)
        self.register_buffer("gain", torch.rand(features, 1) + 0.5)

    def forward(self, x, state):
        state.add_(x.mean(0))
        weight = self.linear.weight * self.gain
        return torch.nn.functional.linear(x, weight, self.linear.bias) + state


class WeightNormConv(torch.nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.conv = weight_norm(torch.nn.Conv1d(features, 2 * features, 3, padding=1))

    def forward(self, x):
        return torch.relu(self.conv(x))


@dataclass(frozen=True)
class Case:
    """One model, hashable, so its lowerings are shared between the pairs of this file."""

    model: str  # "gain_state", "input_state" or "weight_norm"
    features: int = 4
    written: str = "state"
    write: str = "add_"
    order: str = "write_first"

    @property
    def folds(self) -> bool:
        return not (self.model == "gain_state" and self.written == "gain")


@functools.cache
def _model(case: Case) -> torch.nn.Module:
    torch.manual_seed(case.features)
    if case.model == "gain_state":
        return GainState(case.features, case.written, case.write, case.order).eval()
    if case.model == "input_state":
        return InputState(case.features).eval()
    return WeightNormConv(case.features).eval()


def _calls(case: Case) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(1)
    if case.model == "weight_norm":
        return [(torch.randn(1, case.features, 6, generator=generator),) for _ in range(CALLS)]
    xs = [torch.randn(2, case.features, generator=generator) for _ in range(CALLS)]
    if case.model == "input_state":
        return [(x, torch.full((case.features,), float(i))) for i, x in enumerate(xs)]
    return [(x,) for x in xs]


# ---- the pairing, written once ------------------------------------------------


def _export(case: Case, form: str) -> torch.export.ExportedProgram:
    """`as_is`: non-strict export of the model; `functionalized`: the same after
    `run_decompositions({})`; `strict`: strict export; `deep_copy`: its deep copy."""
    model, inputs = _model(case), _calls(case)[0]
    if form == "deep_copy":
        return torch.export.export(copy.deepcopy(model), inputs)
    program = torch.export.export(model, inputs, strict=form == "strict")
    return program.run_decompositions({}) if form == "functionalized" else program


@dataclass(frozen=True)
class Lowered:
    decisions: tuple[tuple[str, bool, str, str], ...]  # sorted (fold, applied, where, detail)
    delegates: int
    outside: Counter[str]
    outputs: tuple[torch.Tensor, ...]  # every output of every call
    inputs: tuple[torch.Tensor, ...]  # every input after its call


# a written buffer starts from its initial value, as in eager (ExecuTorch's default
# serializes only its shape)
_KEEP_INITIAL_STATE = ExecutorchBackendConfig(
    passes=[InitializedMutableBufferPass(["gain", "state"])]
)


@functools.cache
def lowered(case: Case, form: str) -> Lowered:
    """Lower `form` of `case` and run its calls in sequence on one loaded program."""
    with collect_decisions() as journal:
        program = lower_xnnpack(
            _export(case, form),
            [XnnpackPartitioner()],
            lower=to_edge_transform_and_lower,
            executorch_config=_KEEP_INITIAL_STATE,
        )
    calls = [tuple(t.clone() for t in inputs) for inputs in _calls(case)]
    outputs = [o for inputs in calls for o in program.run(*inputs)]
    return Lowered(
        tuple(sorted((d.fold, d.applied, d.where, d.detail) for d in journal)),
        program.delegates(),
        program.ops_outside(),
        tuple(outputs),
        tuple(t for inputs in calls for t in inputs),
    )


# how a decline names the write: the in-place op, or "a functionalized mutation"
_HOW_WRITTEN = re.compile(r"(is written in this method|may write it) \([^)]*\)")


def _spelling_free(decisions) -> list[tuple]:
    """Decisions without node names (but a parameter's) and without how a write is spelt."""
    return sorted(
        (
            fold,
            applied,
            where if fold in NAMED_BY_PARAMETER else "",
            _HOW_WRITTEN.sub(r"\1", detail),
        )
        for fold, applied, where, detail in decisions
    )


def assert_alike(first: Lowered, second: Lowered, *, same_graph: bool, copies: bool = True):
    """Same decisions (in full for one graph exported twice, else `_spelling_free`),
    delegates, ops outside (with `copies`, the write-back copies too) and outputs."""
    if same_graph:
        assert first.decisions == second.decisions
    else:
        assert _spelling_free(first.decisions) == _spelling_free(second.decisions)
    assert any(fold == WEIGHT_FOLD for fold, *_ in first.decisions), "no weight fold decision"
    assert first.delegates == second.delegates

    def outside(lowered: Lowered) -> dict[str, int]:
        return {op: n for op, n in lowered.outside.items() if copies or op != WRITE_BACK_COPY}

    assert outside(first) == outside(second)
    for ours, theirs in ((first.outputs, second.outputs), (first.inputs, second.inputs)):
        assert len(ours) == len(theirs)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def _weight_folded(lowered: Lowered) -> bool:
    return any(applied for fold, applied, *_ in lowered.decisions if fold == WEIGHT_FOLD)


def _eager(case: Case) -> list[torch.Tensor]:
    """What the calls give in eager, on a deep copy (its state carries as the runtime's);
    a method writing a user input returns its new value first, as the runtime does."""
    model, expected = copy.deepcopy(_model(case)), []
    with torch.no_grad():
        for inputs in _calls(case):
            inputs = tuple(t.clone() for t in inputs)
            output = model(*inputs)
            expected += [*inputs[1:], output]
    return expected


def assert_runs_as_eager(case: Case, result: Lowered) -> None:
    assert_close(list(result.outputs), _eager(case), atol=1e-5, rtol=1e-5)


# ---- in-place vs functionalized state --------------------------------------------


def _in_place_and_functionalized_agree(case: Case) -> Lowered:
    as_is, functionalized = lowered(case, "as_is"), lowered(case, "functionalized")
    assert_alike(as_is, functionalized, same_graph=False)
    assert _weight_folded(as_is) == case.folds
    assert_runs_as_eager(case, as_is)
    return as_is


_IN_PLACE_OP = {"add_": "aten.add_.Tensor", "copy_": "aten.copy_.default"}


def _written_reason(how: str) -> str:
    return f"weight stays dynamic: `gain` is written in this method ({how})"


def _weight_fold_reasons(lowered: Lowered) -> list[str]:
    return [detail for fold, applied, _, detail in lowered.decisions if fold == WEIGHT_FOLD]


@pytest.mark.parametrize(
    "written, write, order",
    [
        ("state", "add_", "write_first"),  # a buffer the weight does not read
        ("gain", "add_", "read_first"),  # the weight's buffer, written after the read
        ("gain", "copy_", "write_first"),  # ... and before: the weight reads the write
    ],
)
def test_in_place_and_functionalized_state_decide_and_run_alike(written, write, order):
    case = Case("gain_state", written=written, write=write, order=order)
    as_is = _in_place_and_functionalized_agree(case)
    if not case.folds:  # each form names the write as it knows it
        functionalized = lowered(case, "functionalized")
        assert _weight_fold_reasons(as_is) == [_written_reason(_IN_PLACE_OP[write])]
        assert _weight_fold_reasons(functionalized) == [_written_reason(FUNCTIONALIZED)]


@PAIRS
@given(  # listed so that the first (simplest) draw is none of the hand-written cases
    features=st.sampled_from([8, 4]),
    written=st.sampled_from(["gain", "state"]),
    write=st.sampled_from(["copy_", "add_"]),
    order=st.sampled_from(["read_first", "write_first"]),
)
def test_generated_buffer_writes_decide_and_run_alike_in_place_and_functionalized(
    features, written, write, order
):
    _in_place_and_functionalized_agree(Case("gain_state", features, written, write, order))


def test_a_user_input_written_in_place_decides_and_runs_as_functionalized():
    case = Case("input_state")
    as_is, functionalized = lowered(case, "as_is"), lowered(case, "functionalized")
    assert_alike(as_is, functionalized, same_graph=False, copies=False)
    assert _weight_folded(as_is)
    assert_runs_as_eager(case, as_is)


# ---- strict vs non-strict export, a model vs its deep copy --------------------------

_WRITES_STATE = Case("gain_state", written="state", write="add_", order="write_first")
_WRITES_GAIN = Case("gain_state", written="gain", write="add_", order="read_first")


@pytest.mark.parametrize(
    "case",
    [Case("weight_norm"), _WRITES_STATE, _WRITES_GAIN],
    ids=["weight_norm", "writes_state", "writes_gain"],
)
def test_strict_and_non_strict_export_decide_and_run_alike(case):
    strict, non_strict = lowered(case, "strict"), lowered(case, "as_is")
    assert_alike(strict, non_strict, same_graph=True)
    assert _weight_folded(strict) == case.folds


@pytest.mark.parametrize(
    "case", [Case("weight_norm"), _WRITES_STATE], ids=["weight_norm", "writes_state"]
)
def test_a_model_and_its_deep_copy_decide_and_run_alike(case):
    original, duplicate = lowered(case, "as_is"), lowered(case, "deep_copy")
    assert_alike(original, duplicate, same_graph=True)
    assert _weight_folded(original)
    assert_runs_as_eager(case, original)
