# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The upstream shapes etfold plugs into. An ExecuTorch upgrade that moves any of
them fails here, in one place, instead of deep inside a fold."""

import inspect

import executorch
import executorch.version


def test_executorch_is_the_pinned_release():
    assert executorch.version.__version__.split("+")[0] == "1.5.1"


def test_partitioner_has_the_pre_decomposition_hook():
    from executorch.exir.backend.partitioner import Partitioner

    params = list(inspect.signature(Partitioner.transform_for_pre_decomposition).parameters)
    assert params == ["self", "exported_program"]


def test_to_edge_transform_and_lower_calls_the_hook():
    from executorch.exir.program import _program

    assert "transform_for_pre_decomposition" in inspect.getsource(_program)


def test_arm_pass_insertion_registry():
    from executorch.backends.arm._passes import arm_pass_manager as apm

    for name in ("register_pass_insertions_before", "register_pass_insertions_after"):
        params = list(inspect.signature(getattr(apm, name)).parameters)
        assert params == ["target_pass_type", "passes"], name
    assert isinstance(apm._registered_pass_insertions, dict)
    assert hasattr(apm.ArmPassManager, "_configure_pass_insertions")
    assert hasattr(apm.ArmPassManager, "transform_for_annotation_pipeline")


def test_xnnpack_node_visitor_registry():
    from executorch.backends.xnnpack.operators import node_visitor

    assert isinstance(node_visitor._node_visitor_dict, dict)
    assert callable(node_visitor.register_node_visitor)
    assert callable(node_visitor.get_node_visitors)


def test_xnnpack_partitioner_constructor():
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    params = list(inspect.signature(XnnpackPartitioner.__init__).parameters)
    assert params[:5] == ["self", "configs", "config_precisions", "per_op_mode", "verbose"]


def test_every_lowering_speedup_finds_what_it_replaces_on_the_pinned_versions():
    """On the tested versions no speed-up is switched off; elsewhere they all are, loudly."""
    import etfold.backends.xnnpack  # noqa: F401  (registers its speed-up)
    from etfold.exir.program.lazy_graph_modules import PATCH as LAZY_GRAPH_MODULES
    from etfold.exir.program.speedups import (
        TORCH_PATCHES,
        registered_speedups,
        untested_versions,
        why_unavailable,
    )

    assert untested_versions() == []
    assert registered_speedups()
    assert why_unavailable((*TORCH_PATCHES, *registered_speedups(), LAZY_GRAPH_MODULES)) is None


def test_what_keeping_declared_bounds_reads_and_replaces():
    """Memory planning reads the shape environment's ranges; the fake convolution chooses
    its kernel through `torch._C._select_conv_backend`, which the bounds' patch replaces
    and the replay calls on a shape environment of its own."""
    from executorch.exir import sym_util
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from etfold.exir.program.declared_bounds import PATCH

    PATCH.check()
    assert "var_to_range" in inspect.getsource(sym_util.eval_upper_bound)
    for method in ("suppress_guards", "create_symbol", "create_symintnode"):
        assert callable(getattr(ShapeEnv, method)), method
    assert list(inspect.signature(ShapeEnv.constrain_symbol_range).parameters) == [
        "self",
        "s",
        "compiler_min",
        "compiler_max",
    ]
    env = ShapeEnv()
    assert isinstance(env.backed_var_to_val, dict) and isinstance(env._version_counter, int)
