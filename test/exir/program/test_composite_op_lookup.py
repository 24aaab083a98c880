# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The one-lookup walk collects torch's own set of composite ops and leaves torch as it was.

That lowering inside it gives torch's bytes and that leaving it restores torch is
checked in a fresh interpreter by test_torch_speedups.py, for every scope of
`torch_speedups`.
"""

import torch
import torch.export.exported_program as exported_program

from etfold.exir.program.composite_op_lookup import one_composite_op_lookup_per_walk


def _walk_and_torchs_own():
    walk = exported_program._collect_all_valid_cia_ops
    return walk(), walk.__wrapped__()


def test_a_walk_collects_the_set_torchs_own_walk_collects():
    from torch._export import utils

    judge, lookup = utils._is_preservable_cia_op, utils._materialize_cpp_cia_ops
    with one_composite_op_lookup_per_walk():
        ours, torchs = _walk_and_torchs_own()
        assert utils._is_preservable_cia_op is judge  # torch's judge, never replaced
    assert utils._materialize_cpp_cia_ops is lookup
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


def test_a_walk_looks_the_ops_up_once_and_a_walk_in_another_thread_as_torch_does():
    import threading

    from torch._export import utils

    lookups = []
    torchs_lookup = utils._materialize_cpp_cia_ops

    def counted():
        lookups.append(threading.current_thread().name)
        torchs_lookup()

    utils._materialize_cpp_cia_ops = counted
    try:
        with one_composite_op_lookup_per_walk():
            exported_program._collect_all_valid_cia_ops()
            mine = len(lookups)
            beside = threading.Thread(target=exported_program._collect_all_valid_cia_ops)
            beside.start()
            beside.join()
    finally:
        utils._materialize_cpp_cia_ops = torchs_lookup
    namespaces = len(lookups) - mine
    assert mine == 1 and namespaces > 10
