# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Torch's lowering, minus repeats: the same bytes and provenance, torch left as it was,
nothing lazy handed back, and no other thread touched.

Checked through `lowering_speedups()`, the scope `etfold report` enters (torch's
speedups and XNNPACK's patterns built on demand): a fresh interpreter is the only
place where the patterns have not been built yet. The suite itself runs without
the speed-ups (test/conftest.py); each test here turns them on explicitly.
"""

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.fx import traceback as fx_traceback

from etfold.exir.program.lazy_graph_modules import code_on_first_use_for_graph_modules
from etfold.exir.program.py_kernel_closures import one_py_kernel_closure_per_key
from etfold.exir.program.reentrant_patch import PatchUnavailable, ReentrantPatch, Replacement
from etfold.exir.program.shared_provenance import shared_provenance_chains


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


def _torchs_classes(classes) -> bool:
    return all(cls.__module__.split(".")[0] in ("torch", "builtins") for cls in classes)


def _only_torchs(module: torch.nn.Module) -> bool:
    return _torchs_classes(type(module).__mro__)


def test_a_lowerings_graph_modules_are_lazy_inside_and_torchs_own_once_the_scope_exits():
    from executorch.exir.pass_base import ExportPass
    from torch.fx._lazy_graph_module import _LazyGraphModule
    from torch.fx.graph import PythonCode

    torch.manual_seed(0)
    x = torch.randn(1, 3, 6, 6)
    with code_on_first_use_for_graph_modules():
        program = torch.export.export(ConvTanh().eval(), (x,)).run_decompositions()
        built_by_a_pass = ExportPass()(program.graph_module).graph_module
        built_here = torch.fx.GraphModule(program.graph_module, copy.deepcopy(program.graph))
        lazy_copy = copy.deepcopy(built_by_a_pass)
        lazy = (program.graph_module, built_by_a_pass, lazy_copy)
        assert all(isinstance(m, _LazyGraphModule) and m._needs_recompile() for m in lazy)
        assert not isinstance(built_here, _LazyGraphModule)
    every = (*lazy, built_here, program.module())
    assert all(_only_torchs(m) for m in every)
    assert all(isinstance(m.recompile(), PythonCode) for m in every)
    assert program.graph_module.code == built_here.code
    weights = [program.state_dict[name] for name in program.graph_signature.parameters]
    for module in (*lazy, built_here):
        assert torch.equal(module(*weights, x)[0], program.module()(x))


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
    assert _only_torchs(module) and module._out_spec == wrapped


class _Owner:
    @staticmethod
    def made(x):
        return ("upstream", x)

    def named(self):
        return "upstream"


def test_a_reentrant_patch_installs_once_acts_in_its_context_and_undoes_on_the_last_exit():
    import threading

    patch = ReentrantPatch(
        "probe",
        lambda: [
            Replacement(_Owner, "made", lambda original: lambda x: ("etfold", x)),
            Replacement(_Owner, "named", lambda original: lambda self: "etfold"),
        ],
    )
    upstream = vars(_Owner)["made"], vars(_Owner)["named"]
    beside = {}

    def other_thread():
        beside["seen"] = _Owner.made(1), _Owner().named(), patch.active()

    with patch.scope():
        with patch.scope():
            assert vars(_Owner)["made"] is not upstream[0]
            assert (_Owner.made(1), _Owner().named(), patch.active()) == (
                ("etfold", 1),
                "etfold",
                True,
            )
            thread = threading.Thread(target=other_thread)
            thread.start()
            thread.join()
        assert patch.original(_Owner, "made") is upstream[0]
    assert beside["seen"] == (("upstream", 1), "upstream", False)
    assert (vars(_Owner)["made"], vars(_Owner)["named"]) == upstream
    with pytest.raises(RuntimeError, match="lowering failed"), patch.scope():
        raise RuntimeError("lowering failed")
    assert (vars(_Owner)["made"], vars(_Owner)["named"]) == upstream


def test_a_patch_whose_attribute_is_gone_refuses_before_replacing_anything():
    patch = ReentrantPatch(
        "probe",
        lambda: [
            Replacement(_Owner, "named", lambda original: lambda self: "etfold"),
            Replacement(_Owner, "gone", lambda original: original),
        ],
    )
    with pytest.raises(PatchUnavailable, match="gone"):
        patch.check()
    with pytest.raises(PatchUnavailable), patch.scope():
        pass
    assert _Owner().named() == "upstream"


def test_a_replacement_that_fails_to_build_leaves_upstream_and_no_record():
    def refuse(original):
        raise PatchUnavailable("cannot build")

    patch = ReentrantPatch(
        "probe",
        lambda: [
            Replacement(_Owner, "named", lambda original: lambda self: "etfold"),
            Replacement(_Owner, "made", refuse),
        ],
    )
    upstream = vars(_Owner)["made"], vars(_Owner)["named"]
    with pytest.raises(PatchUnavailable), patch.scope():
        pass
    assert (vars(_Owner)["made"], vars(_Owner)["named"]) == upstream
    assert patch.original(_Owner, "named") is upstream[1]


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
        lookup = export_utils._materialize_cpp_cia_ops
        xnnpack = [ConvertToSDPAPass.call, ConvertToUpsampleBilinear2d.call, sdpa.get_graphs]
        xnnpack += [bilinear_2d.get_graphs_dict]
        torchs = [fx_traceback.copy, OperatorBase.py_impl, graph_module_new, lookup]
        edge = [edge_verifier._check_tensor_args_matching_op_allowed_dtype]
        return [*torchs, *collectors, *xnnpack, *edge]

    def tosa_graphs():
        from etfold.harness.tosa_runner import FP, lower_tosa

        return lower_tosa(copy.deepcopy(program), FP).tosa_graphs

    torchs_own = patched()
    # upstream's lowering inside the scope first (as the report's stock row): it builds no
    # XNNPACK patterns (the Block has no softmax and no bilinear upsample); the same lowering
    # outside then builds them, and the bytes are the same
    with lowering_speedups(True):
        with lowering_speedups(True):
            assert all(a is not b for a, b in zip(patched(), torchs_own))
        ours, our_tosa = lowered(), tosa_graphs()
    assert sdpa.get_graphs.cache_info().misses == 0, "patterns built"
    torchs, torchs_tosa = lowered(), tosa_graphs()
    assert sdpa.get_graphs.cache_info().misses == 1
    assert all(a is b for a, b in zip(patched(), torchs_own)), "torch not restored"
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


def _xnnpack_lowering(program, record=None, **options):
    """etfold's lowering of `program`; `record(graph_module)` runs as a transform pass."""
    from executorch.exir.pass_base import PassResult

    from etfold.backends.xnnpack import XnnpackPartitioner
    from etfold.exir import to_edge_transform_and_lower

    def recording(graph_module):
        record(graph_module)
        return PassResult(graph_module, False)

    passes = [recording] if record else None
    edge = to_edge_transform_and_lower(
        program, transform_passes=passes, partitioner=[XnnpackPartitioner()], **options
    )
    return edge, edge.to_executorch().buffer


def _conv_program():
    torch.manual_seed(0)
    return torch.export.export(ConvTanh().eval(), (torch.randn(1, 3, 6, 6),))


def test_a_make_fx_trace_in_another_thread_while_a_lowering_runs_gets_torchs_own_classes():
    import threading

    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.graph import PythonCode

    traced = {}

    def trace_beside(graph_module):
        def trace():
            traced["module"] = make_fx(lambda x: torch.tanh(x) * 2)(torch.randn(3))
            traced["lowering patched"] = torch.fx.GraphModule.__dict__["__new__"]

        thread = threading.Thread(target=trace)
        thread.start()
        thread.join()
        traced["inside"] = type(graph_module).__mro__

    torchs_new = torch.fx.GraphModule.__dict__["__new__"]
    edge, _ = _xnnpack_lowering(_conv_program(), trace_beside, speedups=True)
    module = traced["module"]
    assert traced["lowering patched"] is not torchs_new  # the trace ran while installed
    assert _only_torchs(module) and isinstance(module.recompile(), PythonCode)
    assert "tanh" in module.code
    assert not _torchs_classes(traced["inside"])  # the lowering's own modules were lazy
    assert _only_torchs(edge.exported_program().graph_module)


def _classes_into(seen: list):
    """A transform pass's record of the classes of the graph module it is handed."""
    return lambda graph_module: seen.append(type(graph_module).__mro__)


def test_a_patched_attribute_gone_switches_the_speedups_off_with_one_warning(monkeypatch):
    from torch._export import utils as export_utils

    from etfold.exir.program.speedups import SpeedupsOffWarning

    _, stock = _xnnpack_lowering(_conv_program(), speedups=False)
    # torch's callers hold their own binding of it: the lowering needs it no more
    monkeypatch.delattr(export_utils, "_collect_all_valid_cia_ops")
    builds = []
    with pytest.warns(SpeedupsOffWarning, match="_collect_all_valid_cia_ops is gone") as caught:
        _, first = _xnnpack_lowering(_conv_program(), _classes_into(builds), speedups=True)
        _, second = _xnnpack_lowering(_conv_program(), _classes_into(builds), speedups=True)
    assert len([w for w in caught if w.category is SpeedupsOffWarning]) == 1
    assert first == second == stock
    assert all(_torchs_classes(c) for c in builds)  # nothing was patched


def test_untested_versions_switch_the_speedups_off_with_a_warning(monkeypatch):
    from etfold.exir.program import speedups

    monkeypatch.setitem(speedups.TESTED_VERSIONS, "torch", ("0.0.1",))
    builds = []
    with pytest.warns(speedups.SpeedupsOffWarning, match="untested versions: torch"):
        _xnnpack_lowering(_conv_program(), _classes_into(builds), speedups=True)
    assert all(_torchs_classes(c) for c in builds)


def test_a_lowering_builder_no_longer_building_graph_modules_switches_the_speedups_off(
    monkeypatch,
):
    """The lazy graph modules match their builders' code: a builder that stops building
    graph modules itself would leave the speed-up matching nothing, so it refuses."""
    from torch.fx.experimental import proxy_tensor

    from etfold.exir.program import lazy_graph_modules as lazy
    from etfold.exir.program import speedups

    with pytest.raises(PatchUnavailable, match="model.build no longer builds a graph module"):
        lazy.check_builds_graph_modules(lambda: None, "model.build")
    lazy.check_builds_graph_modules(proxy_tensor.dispatch_trace, "decorated, looked through")
    assert speedups.why_unavailable((lazy.PATCH,)) is None
    monkeypatch.setattr(lazy, "LOWERING_BUILDERS", (*lazy.LOWERING_BUILDERS, ("json", "dumps")))
    assert speedups.why_unavailable((lazy.PATCH,)) == (
        "lazy_graph_modules: json.dumps no longer builds a graph module itself"
    )


@pytest.mark.parametrize("switch", ["argument", "environment"])
def test_the_speedups_switch_off_by_argument_or_environment(monkeypatch, switch):
    monkeypatch.setenv("ETFOLD_SPEEDUPS", "1" if switch == "argument" else "0")
    options = {"speedups": False} if switch == "argument" else {}
    builds = []
    _xnnpack_lowering(_conv_program(), _classes_into(builds), **options)
    assert builds and all(_torchs_classes(c) for c in builds)
    monkeypatch.setenv("ETFOLD_SPEEDUPS", "1")
    _xnnpack_lowering(_conv_program(), _classes_into(builds))
    assert not _torchs_classes(builds[-1])  # on: lazy inside the lowering
