# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Upstream's tests of `XnnpackDynamicallyQuantizedPartitioner`, run in place from the
executorch wheel with etfold's partitioner in its place.

The wheel holds one: `test_group_partitioner`'s two-layer cross-attention decoder,
dynamically quantized, whose interleaved partition groups must not be merged into a
cycle. It imports the partitioner from upstream's module inside the test, so the
module's name is what is swapped, for the length of the test.
"""

from __future__ import annotations

import importlib
import unittest

import pytest

from etfold.backends.xnnpack import XnnpackDynamicallyQuantizedPartitioner

PARTITIONER_MODULE = "executorch.backends.xnnpack.partition.xnnpack_partitioner"
CASES = [("executorch.exir.backend.test.test_group_partitioner", "TestGroupPartitioner")]
TESTS = {"TestGroupPartitioner": ["test_interleaved_groups_no_false_merge"]}


@pytest.fixture
def built_partitioners(monkeypatch) -> list:
    """Upstream's module name answers with etfold's partitioner; what it built is listed."""
    built = []

    def etfold_partitioner(**kwargs):
        built.append(XnnpackDynamicallyQuantizedPartitioner(**kwargs))
        return built[-1]

    module = importlib.import_module(PARTITIONER_MODULE)
    monkeypatch.setattr(module, "XnnpackDynamicallyQuantizedPartitioner", etfold_partitioner)
    return built


def _cases():
    for module_name, class_name in CASES:
        for test_name in TESTS[class_name]:
            yield pytest.param(module_name, class_name, test_name, id=test_name)


@pytest.mark.parametrize("module_name,class_name,test_name", list(_cases()))
def test_upstream_dq_partitioner_test_passes_with_etfold(
    module_name, class_name, test_name, built_partitioners
):
    case_class = getattr(importlib.import_module(module_name), class_name)
    result = unittest.TestResult()
    unittest.TestSuite([case_class(test_name)]).run(result)
    problems = result.errors + result.failures
    assert not problems, "\n".join(trace for _, trace in problems)
    assert result.testsRun == 1 and not result.skipped
    assert [type(p) for p in built_partitioners] == [XnnpackDynamicallyQuantizedPartitioner]
