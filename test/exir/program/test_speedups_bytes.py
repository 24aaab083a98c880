# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The lowering speed-ups change nothing a user gets back: bytes and classes.

The suite runs without the speed-ups (test/conftest.py); here a representative
set (a CNN, an attention block, a bf16 decoder, a TOSA INT model, a two-method
program) is lowered with them and without, through etfold's entry point and
through upstream's with etfold's partitioner, and the serialized programs (or
the TOSA graphs) must be byte-identical. Every graph module the user can reach
afterwards has only torch's classes, recompiles to torch's `PythonCode`, and
unlifts, prints and re-exports.
"""

from __future__ import annotations

import functools

import pytest
import torch
from executorch.exir import to_edge_transform_and_lower as upstream_lower
from torch.fx.graph import PythonCode

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.demo_models.arm_npu_blocks import Attention
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.inspection import lowered_modules
from etfold.harness.lowering_speedups import lowering_speedups


class SmallCnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, groups=8)

    def forward(self, x):
        return torch.nn.functional.gelu(self.conv2(self.conv1(x).relu())).mean((2, 3))


class TwoHeads(torch.nn.Module):
    """Two methods sharing a weight: `forward` and `scores`."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.linear(x).relu()

    def scores(self, x):
        return self.linear(x).softmax(-1)


def _export(module, inputs):
    return torch.export.export(module.eval(), inputs)


def _cnn():
    torch.manual_seed(0)
    return {"forward": _export(SmallCnn(), (torch.randn(1, 3, 12, 12),))}, {}


def _attention():
    torch.manual_seed(0)
    return {"forward": _export(Attention(32, 2), (torch.randn(1, 8, 32),))}, {}


def _bf16_decoder():
    from etfold.demo_models.mixed_precision_decoders import tiny_llama, token_ids

    pytest.importorskip("transformers")
    decoder = tiny_llama(torch.bfloat16, hidden=32, vocab=64, layers=1)
    return {"forward": _export(decoder, (token_ids(64, 8),))}, {"enable_bf16": True}


def _two_methods():
    torch.manual_seed(0)
    model, x = TwoHeads(), (torch.randn(2, 8),)
    scores = torch.export.export(_Method(model, "scores").eval(), x)
    return {"forward": _export(model, x), "scores": scores}, {}


class _Method(torch.nn.Module):
    def __init__(self, model, name):
        super().__init__()
        self.model, self.name = model, name

    def forward(self, *args):
        return getattr(self.model, self.name)(*args)


XNNPACK_MODELS = {
    "cnn": _cnn,
    "attention": _attention,
    "bf16_decoder": _bf16_decoder,
    "two_methods": _two_methods,
}


def _graph_modules(edge) -> list[torch.fx.GraphModule]:
    """Every graph module reachable from an edge manager: each method's, its submodules,
    and each delegate's original program's."""
    found = []
    for method in edge.methods:
        program = edge.exported_program(method)
        found += [m for m in program.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
        for lowered in lowered_modules(program):
            original = lowered.original_module.graph_module
            found += [m for m in original.modules() if isinstance(m, torch.fx.GraphModule)]
    return found


def _torchs_own(module) -> bool:
    return all(
        cls.__module__.split(".")[0] in ("torch", "builtins") for cls in type(module).__mro__
    )


def _lower(entry_point: str, programs, partitioner_options, speedups: bool):
    partitioner = [XnnpackPartitioner(**partitioner_options)]
    argument = programs if len(programs) > 1 else programs["forward"]
    if entry_point == "etfold":
        return to_edge_transform_and_lower(argument, partitioner=partitioner, speedups=speedups)
    with lowering_speedups(speedups):
        return upstream_lower(argument, partitioner=partitioner)


@functools.cache
def _programs(model: str):
    return XNNPACK_MODELS[model]()


# every model through etfold's entry point; upstream's, with etfold's partitioner, on one
# single- and one multi-method program
CASES = [(model, "etfold") for model in XNNPACK_MODELS] + [
    ("cnn", "upstream"),
    ("two_methods", "upstream"),
]


@pytest.mark.parametrize("model, entry_point", CASES)
def test_a_lowering_with_the_speedups_has_the_bytes_and_classes_of_one_without(model, entry_point):
    programs, options = _programs(model)
    stock = _lower(entry_point, programs, options, speedups=False)
    fast = _lower(entry_point, programs, options, speedups=True)
    modules = _graph_modules(fast)
    assert len(modules) > len(programs)  # the methods' and their delegates'
    assert all(_torchs_own(m) for m in modules), [type(m).__mro__ for m in modules]
    assert all(isinstance(m.recompile(), PythonCode) for m in modules)
    assert fast.to_executorch().buffer == stock.to_executorch().buffer


def test_what_a_sped_up_lowering_hands_back_unlifts_prints_and_re_exports():
    programs, _ = _programs("cnn")
    edge = to_edge_transform_and_lower(
        programs["forward"], partitioner=[XnnpackPartitioner()], speedups=True
    )
    inputs = (torch.randn(1, 3, 12, 12),)
    delegate_program = lowered_modules(edge.exported_program())[0].original_module
    unlifted = delegate_program.module()
    assert _torchs_own(unlifted)
    assert "conv" in unlifted.print_readable(print_output=False)
    again = torch.export.export(unlifted, inputs)
    assert _torchs_own(again.graph_module)
    assert torch.equal(
        *(torch.cat([out.flatten() for out in m(*inputs)]) for m in (again.module(), unlifted))
    )
    assert "executorch_call_delegate" in edge.exported_program().graph_module.code


def test_a_tosa_int_lowering_with_the_speedups_has_the_graphs_of_one_without():
    from executorch.backends.arm.tosa.partitioner import TOSAPartitioner

    from etfold.backends.arm import register_arm_folds
    from etfold.harness.tosa_runner import INT, compile_spec, quantize_for_tosa

    torch.manual_seed(0)
    x = torch.randn(1, 3, 10, 10)
    program = quantize_for_tosa(SmallCnn().eval(), (x,))
    graphs = {}
    with register_arm_folds():
        for speedups in (False, True):
            edge = to_edge_transform_and_lower(
                program, partitioner=[TOSAPartitioner(compile_spec(INT))], speedups=speedups
            )
            assert all(_torchs_own(m) for m in _graph_modules(edge))
            graphs[speedups] = [m.processed_bytes for m in lowered_modules(edge.exported_program())]
    assert graphs[True] and graphs[True] == graphs[False]
