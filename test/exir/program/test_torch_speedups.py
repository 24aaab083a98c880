# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Torch's lowering, minus repeats: the same bytes and provenance, and torch left as it was.

Checked through `lowering_speedups()`, the scope the suite and `etfold report` enter
(torch's speedups and XNNPACK's patterns built on demand): a fresh interpreter is the
only place where the patterns have not been built yet.

The suite runs inside the scope (test/conftest.py), so what torch does outside
it is checked in a fresh interpreter.
"""

import copy
import functools
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.fx import traceback as fx_traceback

from etfold.exir.program.composite_op_overrides import (
    one_override_write_per_composite_op,
    torchs_override,
)
from etfold.exir.program.lazy_graph_modules import code_on_first_use_for_graph_modules
from etfold.exir.program.preservable_op_checks import (
    fixed_preservability_checked_once,
    torchs_check,
)
from etfold.exir.program.py_kernel_closures import one_py_kernel_closure_per_key
from etfold.exir.program.reentrant_patch import ReentrantPatch
from etfold.exir.program.shared_provenance import shared_provenance_chains
from etfold.harness.inspection import every_op_overload


def _chain(length: int) -> list:
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    for step in range(length):
        node.meta["from_node"] = [fx_traceback.NodeSource(node, f"pass_{step}")]
    return node.meta["from_node"]


def test_a_chain_copied_inside_the_scope_is_a_new_list_equal_to_torchs_deep_copy():
    chain = _chain(4)
    torchs = copy.deepcopy(chain)
    with shared_provenance_chains():
        shared = fx_traceback.copy.deepcopy(chain)
        other = fx_traceback.copy.deepcopy({"nested": [[1], [2]]})
    assert shared is not chain and shared == chain == torchs
    assert [link.to_dict() for link in shared] == [link.to_dict() for link in torchs]
    assert other == {"nested": [[1], [2]]}
    assert other["nested"][0] is not fx_traceback.copy.deepcopy(other)["nested"][0]


def test_a_kernel_closure_is_made_once_per_op_and_key_and_registers_as_torchs_does():
    library = torch.library.Library("etfold_py_impl_probe", "DEF")
    try:
        library.define("twice(Tensor x) -> Tensor")
        op = torch.ops.etfold_py_impl_probe.twice.default
        key = torch._C.DispatchKey.CompositeExplicitAutograd
        with one_py_kernel_closure_per_key():
            register = op.py_impl(key)
            assert op.py_impl(key) is register
            assert op.py_impl(torch._C.DispatchKey.CPU) is not register
            kernel = register(lambda x: x + x)
            assert op.py_kernels[key] is kernel
            with pytest.raises(RuntimeError, match="override a python impl"):
                op.py_impl(key)(lambda x: x)
    finally:
        library._destroy()


class ConvTanh(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return torch.tanh(self.conv(x)) * 0.5


def _kernels_of(ops) -> dict:
    """Each op's kernel table and fake-rule registration, with kernels made per call described."""
    from torch._higher_order_ops.utils import autograd_not_implemented
    from torch._subclasses.fake_impls import op_implementations_dict

    refuser = autograd_not_implemented(torch.ops.aten.relu.default, deferred_error=True)

    def described(kernel):
        if isinstance(kernel, functools.partial):
            function = getattr(kernel.func, "__code__", kernel.func)  # torch makes one per call
            return ("partial", function, tuple(kernel.args), tuple(kernel.keywords.items()))
        if getattr(kernel, "__code__", None) is refuser.__code__:
            return ("refuses autograd", kernel.__closure__[1].cell_contents)
        return kernel

    return {
        op: (
            [(key, described(k)) for key, k in op.py_kernels.items()],
            op in op_implementations_dict,
        )
        for op in ops
    }


def test_composite_op_overrides_leave_every_kernel_and_fake_rule_as_torchs_and_restore_them():
    """Inside the override and after it, torch's and the scope's leave the same state (torch's
    exit also drops fake rules registered before it: the scope does as torch does)."""
    from executorch.exir.tracer import _default_decomposition_table
    from torch.export import exported_program

    for table in ({}, _default_decomposition_table()):
        overrides, _ = exported_program._split_decomp_table_to_cia_and_python_decomp(dict(table))
        with torchs_override()(overrides):
            torchs = _kernels_of(overrides)
        torchs_after = _kernels_of(overrides)
        # the override is looked up once the scope is entered
        with (
            one_override_write_per_composite_op(),
            exported_program._override_composite_implicit_decomp(overrides),
        ):
            ours = _kernels_of(overrides)
        assert len(ours) > 400 and ours == torchs
        assert _kernels_of(overrides) == torchs_after


def test_preservability_is_torchs_for_every_op_and_follows_kernel_registrations():
    """Every op judged as torch judges it; an op whose kernels are dropped while the scope is
    open (its library destroyed) is judged again, not from what was cached."""
    from torch._export import utils as export_utils

    outside = export_utils._check_valid_to_preserve
    library = torch.library.Library("etfold_preserve_probe", "DEF")
    library.define("scaled(Tensor x) -> Tensor")
    library.impl("scaled", lambda x: 2 * x, "CompositeImplicitAutograd")
    probe = torch.ops.etfold_preserve_probe.scaled.default
    try:
        with fixed_preservability_checked_once():
            ours = export_utils._check_valid_to_preserve
            assert ours is not torchs_check()
            verdicts = [(op, ours(op), torchs_check()(op)) for op in every_op_overload()]
            registered = ours(probe), torchs_check()(probe)
            library._destroy()
            dropped = ours(probe), torchs_check()(probe)
        assert export_utils._check_valid_to_preserve is outside
    finally:
        library._destroy()
    assert len(verdicts) > 1000 and all(a == b for _, a, b in verdicts)
    assert {a for _, a, _ in verdicts} == {True, False}
    assert registered == (True, True) and dropped == (False, False)


def test_a_lowerings_graph_module_writes_torchs_code_when_first_used_and_others_are_torchs():
    from executorch.exir.pass_base import ExportPass
    from torch.fx._lazy_graph_module import _LazyGraphModule

    torch.manual_seed(0)
    x = torch.randn(1, 3, 6, 6)
    with code_on_first_use_for_graph_modules():
        program = torch.export.export(ConvTanh().eval(), (x,)).run_decompositions()
        built_by_a_pass = ExportPass()(program.graph_module).graph_module
        built_here = torch.fx.GraphModule(program.graph_module, copy.deepcopy(program.graph))
        copied, unlifted = copy.deepcopy(built_here), program.module()
    lazy = (program.graph_module, built_by_a_pass)
    assert all(isinstance(m, _LazyGraphModule) and m._needs_recompile() for m in lazy)
    assert not any(isinstance(m, _LazyGraphModule) for m in (built_here, copied, unlifted))
    assert program.graph_module.code == built_here.code
    weights = [program.state_dict[name] for name in program.graph_signature.parameters]
    for module in (*lazy, built_here):
        assert torch.equal(module(*weights, x)[0], unlifted(x))


def test_a_lazy_graph_modules_pytree_specs_follow_each_recompile_before_any_code():
    from torch.export.exported_program import _create_graph_module_for_export
    from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
    from torch.utils import _pytree as pytree

    unlifted = torch.export.export(ConvTanh().eval(), (torch.randn(1, 3, 6, 6),)).module()
    with code_on_first_use_for_graph_modules():
        module = _create_graph_module_for_export(unlifted, copy.deepcopy(unlifted.graph))
    assert module._needs_recompile()
    assert (module._in_spec, module._out_spec) == (unlifted._in_spec, unlifted._out_spec)
    info = module.graph._codegen.pytree_info
    wrapped = pytree.treespec_tuple([info.out_spec])
    module.graph._codegen = _PyTreeCodeGen(_PyTreeInfo(info.orig_args, info.in_spec, wrapped))
    module.recompile()
    assert module._needs_recompile() and module._out_spec == wrapped


def test_a_reentrant_patch_installs_once_and_undoes_on_the_last_exit():
    calls = []
    patch = ReentrantPatch(lambda: calls.append("install"), lambda: calls.append("uninstall"))
    with patch.scope():
        with patch.scope():
            assert calls == ["install"]
        assert calls == ["install"]
    assert calls == ["install", "uninstall"]
    try:
        with patch.scope():
            raise RuntimeError("lowering failed")
    except RuntimeError:
        pass
    assert calls == ["install", "uninstall", "install", "uninstall"]


_FRESH_INTERPRETER = textwrap.dedent(
    """
    import copy
    import torch
    from torch.fx import traceback as fx_traceback
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    import torch._export.utils as export_utils
    import torch.export.decomp_utils as decomp_utils
    import torch.export.exported_program as exported_program
    from torch._ops import OperatorBase
    from executorch.exir.verification import verifier as edge_verifier
    from executorch.backends.xnnpack._passes.convert_to_sdpa import ConvertToSDPAPass
    from executorch.backends.xnnpack._passes.convert_to_upsample_bilinear2d import (
        ConvertToUpsampleBilinear2d,
    )
    from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa
    from etfold.harness.lowering_speedups import lowering_speedups

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.linear = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.linear(self.conv(x).relu().mean((2, 3))) * 0.5

    torch.manual_seed(0)
    program = torch.export.export(Block().eval(), (torch.randn(1, 3, 8, 8),))

    def without_graph_ids(link):
        # A link names its graph by id(), which differs between any two lowerings.
        return {
            key: [without_graph_ids(l) for l in value] if key == "from_node" else value
            for key, value in link.items()
            if key != "graph_id"
        }

    def lowered():
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
        provenance = [
            [without_graph_ids(link.to_dict()) for link in node.meta.get("from_node", [])]
            for node in edge.exported_program().graph.nodes
        ]
        return edge.to_executorch().buffer, provenance

    def patched():
        collectors = [
            m._collect_all_valid_cia_ops for m in (export_utils, exported_program, decomp_utils)
        ]
        graph_module_new = torch.fx.GraphModule.__dict__["__new__"]
        override = exported_program._override_composite_implicit_decomp
        preservable = export_utils._check_valid_to_preserve
        xnnpack = [ConvertToSDPAPass.call, ConvertToUpsampleBilinear2d.call, sdpa.get_graphs]
        xnnpack += [bilinear_2d.get_graphs_dict, XnnpackPartitioner._check_if_called_from_to_backend]
        torchs = [fx_traceback.copy, OperatorBase.py_impl, graph_module_new, override, preservable]
        edge = [edge_verifier._check_tensor_args_matching_op_allowed_dtype]
        return [*torchs, *collectors, *xnnpack, *edge]

    def tosa_graphs():
        from etfold.harness.tosa_runner import FP, lower_tosa

        return lower_tosa(copy.deepcopy(program), FP).tosa_graphs

    torchs_own = patched()
    torchs_lookup = export_utils._materialize_cpp_cia_ops
    # upstream's lowering inside the scope first (as the report's stock row): it builds no
    # XNNPACK patterns (the Block has no softmax and no bilinear upsample); the same lowering
    # outside then builds them, and the bytes are the same
    with lowering_speedups():
        with lowering_speedups():
            assert all(a is not b for a, b in zip(patched(), torchs_own))
        ours, our_tosa = lowered(), tosa_graphs()
    assert sdpa.get_graphs.cache_info().misses == 0, "patterns built"
    torchs, torchs_tosa = lowered(), tosa_graphs()
    assert sdpa.get_graphs.cache_info().misses == 1
    assert all(a is b for a, b in zip(patched(), torchs_own)), "torch not restored"
    assert export_utils._materialize_cpp_cia_ops is torchs_lookup, "torch not restored"
    assert ours[0] == torchs[0], "program bytes differ"
    assert ours[1] == torchs[1], "provenance differs"
    assert our_tosa == torchs_tosa, "TOSA bytes differ"
    assert any(len(chain) for chain in ours[1])
    print("ok")
    """
)


def test_lowering_inside_the_speedups_gives_torchs_bytes_and_provenance_and_restores_torch():
    result = subprocess.run(
        [sys.executable, "-c", _FRESH_INTERPRETER], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
