# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Importing etfold, every module of it, leaves upstream ExecuTorch exactly as it was."""

import functools
import json
import subprocess
import sys
import textwrap

_PROBE = textwrap.dedent(
    """
    import importlib, pkgutil, json

    def snapshot():
        from executorch.backends.arm._passes import arm_pass_manager as apm
        from executorch.backends.xnnpack.operators import node_visitor
        from executorch.backends.xnnpack.partition import config as xnn_config
        from executorch.backends.xnnpack import xnnpack_preprocess
        from executorch.backends.xnnpack import _passes as xnn_passes
        return {
            "arm_insertions": sorted(t.__name__ for t in apm._registered_pass_insertions),
            "arm_manager": sorted(k for k, v in vars(apm.ArmPassManager).items() if callable(v)),
            "arm_manager_ids": sorted(str(id(v)) for v in vars(apm.ArmPassManager).values() if callable(v)),
            "xnn_visitors": sorted((str(k), v.__qualname__) for k, v in node_visitor._node_visitor_dict.items()),
            "xnn_configs": [c.__qualname__ for c in xnn_config.ALL_PARTITIONER_CONFIGS],
            "xnn_preprocess": sorted(str(id(v)) for v in vars(xnnpack_preprocess.XnnpackBackend).values()),
            "xnn_pass_manager": sorted(str(id(v)) for v in vars(xnn_passes.XNNPACKPassManager).values()),
        }

    before = snapshot()
    import etfold
    roots = ["etfold", "etfold.backends", "etfold.exir"]
    for root in roots:
        package = importlib.import_module(root)
        for info in pkgutil.walk_packages(package.__path__, root + "."):
            importlib.import_module(info.name)
    after_import = snapshot()
    from executorch.backends.arm._passes import arm_pass_manager as apm
    from executorch.backends.arm._passes import InsertTableOpsPass
    apm.register_pass_insertions_before(InsertTableOpsPass, [])
    after_a_registration = snapshot()
    print(json.dumps({
        "import": {k: before[k] == after_import[k] for k in before},
        "registration": {k: before[k] == after_a_registration[k] for k in before},
    }))
    """
)


@functools.cache
def _unchanged() -> dict[str, dict[str, bool]]:
    """Which snapshots match the one taken before: after importing etfold, after a registration.

    One interpreter answers both, so the probe that proves etfold changed nothing
    is the very probe shown to see a change.
    """
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_every_etfold_module_changes_no_upstream_registry():
    unchanged = _unchanged()["import"]
    assert all(unchanged.values()), (
        f"changed on import: {[k for k, same in unchanged.items() if not same]}"
    )


def test_the_probe_sees_a_registration():
    assert _unchanged()["registration"]["arm_insertions"] is False
