# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The one-lookup walk collects torch's own set of composite ops and leaves torch as it was.

The suite runs inside the scope (test/conftest.py); that lowering inside it
gives torch's bytes and that leaving it restores torch is checked in a fresh
interpreter by test_torch_speedups.py, for every scope of `torch_speedups`.
"""

import torch
import torch.export.exported_program as exported_program

from etfold.exir.program.composite_op_lookup import (
    _composite_first,
    one_composite_op_lookup_per_walk,
)
from etfold.harness.inspection import every_op_overload


def _walk_and_torchs_own():
    walk = exported_program._collect_all_valid_cia_ops
    return walk(), walk.__wrapped__()


def test_a_walk_collects_the_set_torchs_own_walk_collects():
    from torch._export import utils

    judge, lookup = utils._is_preservable_cia_op, utils._materialize_cpp_cia_ops
    with one_composite_op_lookup_per_walk():
        ours, torchs = _walk_and_torchs_own()
        # what the walk swaps in for its own duration is torch's again once it returns
        assert (utils._is_preservable_cia_op, utils._materialize_cpp_cia_ops) == (judge, lookup)
    assert ours == torchs
    assert torch.ops.aten.linear.default in ours


def test_an_op_library_defined_between_two_walks_is_collected_then_forgotten():
    probe = "etfold_cia_probe"
    with one_composite_op_lookup_per_walk():
        library = torch.library.Library(probe, "DEF")
        try:
            library.define("twice(Tensor x) -> Tensor")
            library.impl("twice", lambda x: x + x, "CompositeImplicitAutograd")
            ours, torchs = _walk_and_torchs_own()
            assert torch.ops.etfold_cia_probe.twice.default in ours
            assert ours == torchs
        finally:
            library._destroy()
        ours, torchs = _walk_and_torchs_own()
    assert not any(op.name().startswith(probe) for op in ours)
    assert ours == torchs


def test_every_op_is_judged_preservable_as_torch_judges_it_python_composite_kernels_included():
    from torch._export import utils

    library = torch.library.Library("etfold_py_composite_probe", "DEF")
    try:
        library.define("scaled(Tensor x) -> Tensor")
        library.impl("scaled", lambda x: 2 * x, "CPU")
        probe = torch.ops.etfold_py_composite_probe.scaled.default
        probe.py_impl(torch._C.DispatchKey.CompositeImplicitAutograd)(lambda x: 2 * x)
        registered = torch._C._dispatch_get_registrations_for_dispatch_key(
            "CompositeImplicitAutograd"
        )
        ours = _composite_first(frozenset(registered), utils)
        ops = list(every_op_overload())
        verdicts = {op: ours(op) for op in ops}
        assert len(ops) > 1000 and sum(verdicts.values()) > 400 and verdicts[probe]
        assert verdicts == {op: utils._is_preservable_cia_op(op) for op in ops}
    finally:
        library._destroy()
