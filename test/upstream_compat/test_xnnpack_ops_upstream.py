# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Upstream's XNNPACK op tests for `_to_copy`, GELU, conv1d, and the ops etfold's
exact rewrites produce (mean, mul, slice, cat), run in place from the executorch
wheel with etfold's lowering substituted at the narrowest points:

- the harness stage's `to_edge_transform_and_lower` -> etfold's;
- the XNNPACK tester's default `XnnpackPartitioner` -> etfold's;
- names a test module imported itself (`XnnpackPartitioner`, `constant_prop_pass`)
  -> etfold's.

A test left out below is a deliberate difference, documented in CONTRIBUTING.md
under "Deliberate differences from upstream". The rewrites' modules run in full
in the long profile; `make test` runs one fp32 and one fp16 test of each (and
conv1d's plain int8 test, and every `_to_copy` test but the quantized one).
"""

from __future__ import annotations

import importlib
import unittest

import pytest

import etfold.exir
from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.exir.passes.constant_prop_pass import constant_prop_pass

OPS = "executorch.backends.xnnpack.test.ops"
STAGE = "executorch.backends.test.harness.stages.to_edge_transform_and_lower"
TESTER = "executorch.backends.xnnpack.test.tester.tester"
MODULES = {
    f"{OPS}.test_to_copy": "TestChannelsLastTaggedReshapePass",
    f"{OPS}.test_gelu": "TestGelu",
    f"{OPS}.test_conv1d": "TestConv1d",
    f"{OPS}.test_mean_dim": "TestMeanDim",
    f"{OPS}.test_multiply": "TestMul",
    f"{OPS}.test_slice_copy": "TestSliceCopy",
    f"{OPS}.test_cat": "TestCat",
}
# modules whose other tests run in the long profile only
SAMPLED = {
    "test_conv1d": {"test_fp32_conv1d", "test_fp16_conv1d", "test_qs8_conv1d"},
    "test_to_copy": {
        "test_channel_last_before_linear",
        "test_contiguous_before_conv",
        "test_dtype_and_memory_format_conversion",
        "test_dtype_and_memory_format_with_linear",
    },
    "test_mean_dim": {"test_fp32_mean_dim", "test_fp16_mean_dim"},
    "test_multiply": {"test_fp32_mul", "test_fp16_mul"},
    "test_slice_copy": {"test_fp32_slice_copy", "test_fp16_slice_copy"},
    "test_cat": {"test_fp32_cat3", "test_fp16_cat3"},
}
# what each module may have imported for itself -> etfold's replacement
REPLACEMENTS = {"XnnpackPartitioner": XnnpackPartitioner, "constant_prop_pass": constant_prop_pass}
# test id -> why etfold differs on purpose (CONTRIBUTING.md, "Deliberate differences from upstream")
DELIBERATE = {
    "test_gelu::test_fp16_gelu": (
        "deliberate difference: XNNPACK has no fp16 GELU; etfold delegates it computed in fp32 "
        "between two converts, the test asserts upstream leaves it on portable kernels"
    ),
    "test_mean_dim::test_fp32_mean_dim_unsupported": (
        "deliberate difference: a mean over the last dim alone is the 4-D mean over the last "
        "two of a view (exact); etfold delegates it, the test asserts it stays outside"
    ),
}


def _cases():
    for module_name, class_name in MODULES.items():
        case_class = getattr(importlib.import_module(module_name), class_name)
        for name in unittest.TestLoader().getTestCaseNames(case_class):
            short_name = module_name.rsplit(".", 1)[1]
            test_id = f"{short_name}::{name}"
            marks = [pytest.mark.skip(reason=DELIBERATE[test_id])] if test_id in DELIBERATE else []
            if short_name in SAMPLED and name not in SAMPLED[short_name]:
                marks.append(pytest.mark.long)
            yield pytest.param(module_name, class_name, name, id=test_id, marks=marks)


@pytest.fixture
def etfold_lowering(monkeypatch):
    """Upstream's XNNPACK tester, lowering through etfold for the length of one test."""
    monkeypatch.setattr(
        importlib.import_module(STAGE),
        "to_edge_transform_and_lower",
        etfold.exir.to_edge_transform_and_lower,
    )
    monkeypatch.setattr(importlib.import_module(TESTER), "XnnpackPartitioner", XnnpackPartitioner)
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, replacement in REPLACEMENTS.items():
            if hasattr(module, name):
                monkeypatch.setattr(module, name, replacement)


def test_substitution_reaches_the_lowering_stage(etfold_lowering):
    tester = importlib.import_module(TESTER)
    [partitioner] = tester.ToEdgeTransformAndLower().partitioners
    assert type(partitioner) is XnnpackPartitioner
    stage = importlib.import_module(STAGE)
    assert stage.to_edge_transform_and_lower is etfold.exir.to_edge_transform_and_lower


@pytest.mark.parametrize("module_name,class_name,test_name", list(_cases()))
def test_upstream_xnnpack_op_test_passes_with_etfold(
    module_name, class_name, test_name, etfold_lowering
):
    case_class = getattr(importlib.import_module(module_name), class_name)
    result = unittest.TestResult()
    unittest.TestSuite([case_class(test_name)]).run(result)
    if result.skipped:
        pytest.skip("; ".join(reason for _, reason in result.skipped))
    problems = result.errors + result.failures
    assert not problems, "\n".join(trace for _, trace in problems)
    assert result.testsRun == 1
