# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Programs a user cannot tell apart fold alike on Arm.

Each pair lowers two spellings of one program through stock
`to_edge_transform_and_lower` with `register_arm_folds()`, and asserts the same
scalar-mul decisions (applied, or declined with the same reason) and the same
outputs on the TOSA reference model: in-place vs functionalized state (buffer
and user input), strict vs non-strict export, a model vs its deep copy, and
shared-weight twins whose results never meet vs the same convs with separate
weights.

In-place vs functionalized compares outputs on FP only: on INT, stock's
quantization flow freezes a buffer that the converted module updates in place
into a constant (the in-place form never writes it back), so the two forms
quantize different programs. Their INT decisions must still agree.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.arm import arm_folds_registered
from etfold.backends.arm._passes import fold_scalar_mul_into_conv_pass as fold
from etfold.decisions import collect_decisions
from etfold.harness.tosa_runner import (
    FP,
    INT,
    lower_tosa,
    quantize_exported_for_tosa,
    run_carried,
)

# ---- the pairing, written once ----------------------------------------------


@dataclass(frozen=True)
class Lowered:
    decisions: tuple[tuple[bool, str], ...]  # (applied, reason or kind of scale folded)
    outputs: tuple[torch.Tensor, ...]  # every output of every step, in order


def _decision(applied: bool, detail: str) -> tuple[bool, str]:
    # an applied fold names the constants it made, which differ between spellings
    return applied, detail.split(":", 1)[0] if applied else detail


def lower_and_run(
    export: Callable[[], torch.export.ExportedProgram],
    profile: str,
    steps: list[tuple[torch.Tensor, ...]],
    *,
    run: bool = True,
) -> Lowered:
    """Export, quantize (INT, calibrating on `steps`), lower with the folds registered,
    and (with `run`) run `steps` in sequence on one instance (buffers and inputs
    carry over)."""
    with arm_folds_registered(), collect_decisions() as journal:
        program = export()
        if profile == INT:
            program = quantize_exported_for_tosa(program, steps[0], calibration=steps)
        lowered = lower_tosa(program, profile)
    decisions = tuple(_decision(d.applied, d.detail) for d in journal if d.fold == fold.FOLD)
    if not run:
        return Lowered(tuple(sorted(decisions)), ())
    steps = [tuple(t.clone() for t in step) for step in steps]
    outputs = [o for result in run_carried(lowered, steps) for o in result.outputs]
    outputs += [t for step in steps for t in step]  # inputs written in place
    return Lowered(tuple(sorted(decisions)), tuple(outputs))


def assert_alike(first: Lowered, second: Lowered, *, atol: float | None) -> None:
    """Same decisions; with `atol`, outputs within it (0: bit for bit)."""
    assert first.decisions == second.decisions
    assert first.decisions, "the pair decided nothing: it tests nothing"
    if atol is None:
        return
    assert len(first.outputs) == len(second.outputs)
    for a, b in zip(first.outputs, second.outputs, strict=True):
        assert float((a - b).abs().max()) <= atol


def _steps(shape, n: int, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=generator),) for _ in range(n)]


# ---- in-place vs functionalized state ----------------------------------------


class BufferState(torch.nn.Module):
    """state <- state + conv(x) * s (`add_`), or state <- conv(x) * s (`copy_`)."""

    def __init__(self, write: str, scale: float = 0.3):
        super().__init__()
        self.write, self.scale = write, scale
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.register_buffer("state", torch.zeros(1, 4, 6, 6))

    def forward(self, x):
        getattr(self.state, self.write)(self.conv(x) * self.scale)
        return self.state * 1.0


class InputState(torch.nn.Module):
    """The same with the state passed in by the caller and written in place."""

    def __init__(self, write: str, scale: float = 0.3):
        super().__init__()
        self.write, self.scale = write, scale
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x, state):
        getattr(state, self.write)(self.conv(x) * self.scale)
        return state * 1.0


def _state_case(where: str, write: str):
    torch.manual_seed(0)
    if where == "buffer":
        return BufferState(write).eval(), _steps((1, 4, 6, 6), 4)
    steps = [(x, torch.zeros(1, 4, 6, 6)) for (x,) in _steps((1, 4, 6, 6), 4)]
    return InputState(write).eval(), steps


def _exports(model, inputs) -> dict[str, Callable[[], torch.export.ExportedProgram]]:
    def in_place():
        return torch.export.export(copy.deepcopy(model), inputs)

    def functionalized():
        return in_place().run_decompositions({})

    return {"in_place": in_place, "functionalized": functionalized}


# (stock cannot quantize a user input written by `copy_`: ScalarsToAttributePass fails)
@pytest.mark.parametrize(
    "where, write", [("buffer", "add_"), ("buffer", "copy_"), ("user_input", "add_")]
)
def test_in_place_and_functionalized_state_decide_alike_on_int(where, write):
    model, steps = _state_case(where, write)
    forms = _exports(model, steps[0])
    in_place, functionalized = (lower_and_run(forms[f], INT, steps[:2], run=False) for f in forms)
    assert_alike(in_place, functionalized, atol=None)
    # `add_` leaves state + conv(x) * s, rounded by the add: the multiply's rounding
    # is an intermediate one and folds; `copy_` makes the product the state itself
    expected = (True, "scalar scale folded") if write == "add_" else (False, fold.CARRIED_STATE)
    assert in_place.decisions == (expected,)


@pytest.mark.parametrize("where", ["buffer", "user_input"])
def test_in_place_and_functionalized_state_decide_and_run_alike_on_fp(where):
    model, steps = _state_case(where, "add_")
    forms = _exports(model, steps[0])
    in_place, functionalized = (lower_and_run(forms[f], FP, steps) for f in forms)
    assert_alike(in_place, functionalized, atol=1e-5)
    assert in_place.decisions == ((True, "scalar scale folded"),)


def test_functionalized_copy_state_keeps_its_mul_on_fp_as_in_place_does():
    model, steps = _state_case("buffer", "copy_")
    forms = _exports(model, steps[0])
    in_place, functionalized = (lower_and_run(forms[f], FP, steps) for f in forms)
    assert_alike(in_place, functionalized, atol=1e-5)
    assert in_place.decisions == ((False, fold.CARRIED_STATE),)


# ---- shared-weight twins, export spellings, deep copies ------------------------


class Twins(torch.nn.Module):
    """Two conv1d's on the same input, each scaled by its own factor, returned apart;
    with `shared`, the second reads the first's weight."""

    def __init__(self, first: torch.Tensor, second: torch.Tensor, shared: bool = True):
        super().__init__()
        self.a = torch.nn.Conv1d(3, 8, 3, padding=1)
        self.b = torch.nn.Conv1d(3, 8, 3, padding=1)
        if shared:
            self.b.weight = self.a.weight
        else:
            self.b.weight = torch.nn.Parameter(self.a.weight.detach().clone())
        self.register_buffer("first", first)
        self.register_buffer("second", second)

    def forward(self, x):
        return self.a(x) * self.first, self.b(x) * self.second


def _twins(scales, shared: bool = True) -> Twins:
    torch.manual_seed(0)
    first, second = (torch.as_tensor(s, dtype=torch.float32) for s in scales)
    return Twins(first, second, shared).eval()


_TWIN_STEPS = _steps((1, 3, 16), 3, seed=1)


def _exported(model, strict: bool = False):
    return lambda: torch.export.export(copy.deepcopy(model), _TWIN_STEPS[0], strict=strict)


_channel_scale = st.lists(
    st.sampled_from([-2.0, -0.75, 0.3, 0.5, 1.5, 3.0]), min_size=8, max_size=8
).map(lambda v: torch.tensor(v).reshape(1, 8, 1))
_scale = st.one_of(st.sampled_from([-1.5, 0.3, 0.5, 3.0]).map(torch.tensor), _channel_scale)


@settings(max_examples=2)
@given(first=_scale, second=_scale)
def test_twins_that_never_meet_fold_as_separate_weights_do_on_int(first, second):
    twins = lower_and_run(_exported(_twins((first, second))), INT, _TWIN_STEPS)
    separate = lower_and_run(_exported(_twins((first, second), shared=False)), INT, _TWIN_STEPS)
    assert_alike(twins, separate, atol=0.0)
    assert all(applied for applied, _ in twins.decisions) and len(twins.decisions) == 2


def test_twins_that_never_meet_fold_as_separate_weights_do_on_fp():
    scales = (torch.tensor(0.5), torch.linspace(-1.0, 3.0, 8).reshape(1, 8, 1))
    twins = lower_and_run(_exported(_twins(scales)), FP, _TWIN_STEPS)
    separate = lower_and_run(_exported(_twins(scales, shared=False)), FP, _TWIN_STEPS)
    assert_alike(twins, separate, atol=1e-5)
    assert [applied for applied, _ in twins.decisions] == [True, True]


@pytest.mark.parametrize("profile", [INT, FP])
def test_strict_and_non_strict_export_decide_and_run_alike(profile):
    model = _twins((0.5, -1.5))
    strict = lower_and_run(_exported(model, strict=True), profile, _TWIN_STEPS)
    non_strict = lower_and_run(_exported(model, strict=False), profile, _TWIN_STEPS)
    assert_alike(strict, non_strict, atol=0.0)


def test_a_model_and_its_deep_copy_decide_and_run_alike():
    model, steps = _state_case("buffer", "add_")
    original = lower_and_run(lambda: torch.export.export(model, steps[0]), FP, steps)
    copied = copy.deepcopy(model)
    duplicate = lower_and_run(lambda: torch.export.export(copied, steps[0]), FP, steps)
    assert_alike(original, duplicate, atol=0.0)
