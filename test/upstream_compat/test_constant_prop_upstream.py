# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Upstream's own tests for `constant_prop_pass`, run in place from the executorch wheel
with etfold's `constant_prop_pass` substituted where each test module looks it up.

Only the tests that call `constant_prop_pass` are selected. A test left out of a
list below is a deliberate difference, documented in CONTRIBUTING.md under
"Deliberate differences from upstream".
"""

from __future__ import annotations

import importlib
import unittest

import pytest

from etfold.exir.passes.constant_prop_pass import constant_prop_pass

# module -> (TestCase class, tests that call constant_prop_pass)
SELECTED = {
    "executorch.exir.tests.test_passes": (
        "TestPasses",
        (
            "test_constant_prop_for_output",
            "test_constant_prop_preserves_memory_alloc",
            "test_constant_prop_pass_for_add",
            "test_constant_prop_pass_for_parameter",
            "test_constant_prop_pass_graph_signature",
            "test_constant_prop_pass_after_delegation",
            "test_constant_prop_pass_for_parameter_slice",
            "test_constant_prop_pass_no_propagate",
            "test_constant_prop_pass_for_control_flow",
            "test_constant_prop_pass_quant_primitives",
            "test_constant_prop_pass_for_mutable_buffers",
            "test_constant_prop_pass_for_no_grad",
            "test_constant_prop_pass_none",
            "test_constant_prop_pass_skips_nondeterministic_ops",
            "test_constant_prop_pass_zero_stride_tensors",
        ),
    ),
    "executorch.exir.emit.test.test_emit": ("TestEmit", ("test_non_const_buffer_sizes",)),
    "executorch.exir.tests.test_quant_fusion_pass": (
        "TestQuantFusionPass",
        ("test_embedding_torchao",),
    ),
}

# the three that lower whole programs (10-40 s each) run in the long profile only
LONG = {
    "test_constant_prop_pass_after_delegation",
    "test_constant_prop_pass_for_no_grad",
    "test_embedding_torchao",
}

CASES = [
    pytest.param(
        module,
        cls,
        name,
        id=f"{module.rsplit('.', 1)[1]}::{name}",
        marks=[pytest.mark.long] if name in LONG else [],
    )
    for module, (cls, names) in SELECTED.items()
    for name in names
]


def run_upstream_test(case_class: type[unittest.TestCase], name: str) -> None:
    """Run one upstream unittest method with its class fixtures; fail with its tracebacks."""
    result = unittest.TestResult()
    unittest.TestSuite([case_class(name)]).run(result)
    if result.skipped:
        pytest.skip("; ".join(reason for _, reason in result.skipped))
    problems = result.errors + result.failures
    assert not problems, "\n".join(trace for _, trace in problems)
    assert result.testsRun == 1


@pytest.mark.parametrize("module_name,class_name,test_name", CASES)
def test_upstream_constant_prop_test_passes_with_etfold(
    module_name, class_name, test_name, monkeypatch
):
    module = importlib.import_module(module_name)
    assert module.constant_prop_pass.__module__.startswith("executorch.")
    monkeypatch.setattr(module, "constant_prop_pass", constant_prop_pass)
    run_upstream_test(getattr(module, class_name), test_name)
