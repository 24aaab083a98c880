# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Upstream's own tests for the Arm passes etfold replaces, run in place against etfold.

The test modules ship inside the executorch wheel
(`executorch.backends.arm.test.passes`). Each of their test functions runs here
as it is, with etfold's pass class substituted for upstream's where the test
looks it up (its own module globals and the upstream pass module it imports
lazily), and with etfold's Arm folds registered, so the quantizer's annotation
pipeline runs etfold's folds where upstream's ran; both are undone when the
test ends. Nothing is copied.

Tests that still fail are deliberate differences, each listed with its reason
in `DELIBERATE_DIFFERENCES` (and in CONTRIBUTING.md, "Deliberate differences
from upstream"); they are deselected, and a test checks the list names real
upstream tests.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

import pytest

from etfold.backends.arm import arm_folds_registered

pytest.importorskip("executorch.backends.arm.test.passes")

UPSTREAM_TESTS = "executorch.backends.arm.test.passes."
UPSTREAM_PASSES = "executorch.backends.arm._passes."
ETFOLD_PASSES = "etfold.backends.arm._passes."

# upstream test module -> (pass module stem, class name) pairs it exercises
SUBSTITUTIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "test_fold_dyt_affine_into_conv_pass": (
        ("fold_dyt_affine_into_conv_pass", "FoldDyTAffineIntoConvPass"),
        ("fold_dyt_alpha_into_lut_pass", "FoldDyTAlphaIntoLUTPass"),
    ),
    "test_fold_dyt_alpha_into_lut_pass": (
        ("fold_dyt_alpha_into_lut_pass", "FoldDyTAlphaIntoLUTPass"),
    ),
    "test_fold_scalar_mul_into_conv_pass": (
        ("fold_scalar_mul_into_conv_pass", "FoldScalarMulIntoConvPass"),
    ),
}

# "module::test" -> why etfold deliberately behaves differently (see CONTRIBUTING.md)
DELIBERATE_DIFFERENCES: dict[str, str] = {
    "test_fold_dyt_affine_into_conv_pass::test_channel_narrowing_slice_is_rejected": (
        "etfold reads the slice's bounds and folds each kept channel's exact affine map into "
        "the conv (bit-exact on the TOSA reference model: test/backends/arm/"
        "test_fold_dyt_affine_into_conv_pass.py, ChannelSlice); upstream does not read "
        "slice bounds and declines"
    ),
    **{
        f"{module}::{test}": (
            "the alpha multiply sits on a conv's output behind a permute, so etfold's "
            "scalar-mul fold (which reaches through layout ops) folds alpha into the conv "
            "weight before calibration; no alpha is left for FoldDyTAlphaIntoLUTPass and the "
            "tanh becomes a TABLE in InsertTableOpsPass, which the test's partial pipeline "
            "does not run. Lowered in full: the same TOSA ops as alpha in the TABLE and the "
            "unfolded lowering's codes (test/backends/arm/test_fold_layer_scale.py, "
            "test_dyt_alpha_after_a_conv_folds_into_the_conv_leaving_the_tanh_table)"
        )
        for module, test in (
            ("test_fold_dyt_affine_into_conv_pass", "test_fold_dyt_affine_into_conv_tosa_INT"),
            ("test_fold_dyt_alpha_into_lut_pass", "test_fold_dyt_alpha_into_lut_tosa_INT"),
        )
    },
}


@dataclass(frozen=True)
class UpstreamCase:
    module: str
    test: str
    kwargs: tuple[tuple[str, object], ...] = ()


def _expanded(module_name: str, name: str, function) -> list:
    """One pytest param per upstream parametrization (common.parametrize is pytest's)."""
    cases = [({}, "")]
    for mark in getattr(function, "pytestmark", ()):
        if mark.name != "parametrize":
            continue
        arg_names = [a.strip() for a in mark.args[0].split(",")]
        expanded = []
        for kwargs, suffix in cases:
            for index, param in enumerate(mark.args[1]):
                values = param.values if hasattr(param, "values") else (param,)
                pid = getattr(param, "id", None) or str(index)
                expanded.append(
                    ({**kwargs, **dict(zip(arg_names, values, strict=True))}, f"{suffix}[{pid}]")
                )
        cases = expanded
    return [
        pytest.param(
            UpstreamCase(module_name, name, tuple(kwargs.items())),
            id=f"{module_name}::{name}{suffix}",
        )
        for kwargs, suffix in cases
    ]


def _upstream_cases() -> list:
    params = []
    for module_name in SUBSTITUTIONS:
        module = importlib.import_module(UPSTREAM_TESTS + module_name)
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if not name.startswith("test_") or function.__module__ != module.__name__:
                continue
            if f"{module_name}::{name}" in DELIBERATE_DIFFERENCES:
                continue
            params.extend(_expanded(module_name, name, function))
    return params


def _substitute(monkeypatch, module_name: str) -> None:
    test_module = importlib.import_module(UPSTREAM_TESTS + module_name)
    for stem, class_name in SUBSTITUTIONS[module_name]:
        etfold_class = getattr(importlib.import_module(ETFOLD_PASSES + stem), class_name)
        monkeypatch.setattr(
            importlib.import_module(UPSTREAM_PASSES + stem), class_name, etfold_class
        )
        if hasattr(test_module, class_name):
            monkeypatch.setattr(test_module, class_name, etfold_class)


@pytest.mark.parametrize("case", _upstream_cases())
def test_upstream_test_passes_against_etfold(case: UpstreamCase, monkeypatch):
    _substitute(monkeypatch, case.module)
    test_module = importlib.import_module(UPSTREAM_TESTS + case.module)
    with arm_folds_registered():
        getattr(test_module, case.test)(**dict(case.kwargs))


def test_every_deliberate_difference_names_an_upstream_test():
    for key in DELIBERATE_DIFFERENCES:
        module_name, _, name = key.partition("::")
        module = importlib.import_module(UPSTREAM_TESTS + module_name)
        assert callable(getattr(module, name, None)), key


def test_substitution_is_undone(monkeypatch):
    upstream = importlib.import_module(UPSTREAM_PASSES + "fold_dyt_affine_into_conv_pass")
    original = upstream.FoldDyTAffineIntoConvPass
    with monkeypatch.context() as scoped:
        _substitute(scoped, "test_fold_dyt_affine_into_conv_pass")
        assert upstream.FoldDyTAffineIntoConvPass is not original
    assert upstream.FoldDyTAffineIntoConvPass is original
