# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The one-lookup walk collects torch's own set of composite ops and leaves torch as it was.

The suite runs inside the scope (test/conftest.py), so what torch does outside
it is checked in a fresh interpreter.
"""

import subprocess
import sys
import textwrap

import torch
import torch.export.exported_program as exported_program

from etfold.exir.program.composite_op_lookup import one_composite_op_lookup_per_walk


def _walk_and_torchs_own():
    walk = exported_program._collect_all_valid_cia_ops
    return walk(), walk.__wrapped__()


def test_a_walk_collects_the_set_torchs_own_walk_collects():
    with one_composite_op_lookup_per_walk():
        ours, torchs = _walk_and_torchs_own()
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


_FRESH_INTERPRETER = textwrap.dedent(
    """
    import torch
    import torch._export.utils as utils
    import torch.export.decomp_utils as decomp_utils
    import torch.export.exported_program as exported_program
    from etfold.exir.program.composite_op_lookup import one_composite_op_lookup_per_walk

    bound = (utils, exported_program, decomp_utils)
    before = [m._collect_all_valid_cia_ops for m in bound] + [utils._materialize_cpp_cia_ops]

    class Block(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.linear(x, x).softmax(-1).mean(0)

    def decomposed_code():
        program = torch.export.export(Block(), (torch.randn(3, 3),))
        return program.run_decompositions().graph_module.code

    torchs_code = decomposed_code()
    with one_composite_op_lookup_per_walk():
        with one_composite_op_lookup_per_walk():
            inside = [m._collect_all_valid_cia_ops for m in bound]
            assert all(f is not b for f, b in zip(inside, before))
        assert [m._collect_all_valid_cia_ops for m in bound] == inside
        assert decomposed_code() == torchs_code
    after = [m._collect_all_valid_cia_ops for m in bound] + [utils._materialize_cpp_cia_ops]
    assert all(a is b for a, b in zip(after, before)), "torch not restored"
    print("ok")
    """
)


def test_leaving_the_scope_gives_torch_back_and_decompositions_never_differ():
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_INTERPRETER], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
