# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""etfold's constant_prop_pass: what folds, what never does, how folds are named and placed.

Every test checks the graph after the pass and the numbers: eager (`ep.module()` or
positional binding) and, where a program is lowered, the XNNPACK runtime.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import logging
import operator
import sys

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, memory, to_edge
from executorch.exir.dialects._ops import ops as exir_ops
from executorch.exir.passes.constant_prop_pass import (
    constant_prop_pass as upstream_constant_prop_pass,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.export.graph_signature import InputKind

from etfold.decisions import collect_decisions
from etfold.exir import constant_prop_pass, to_edge_transform_and_lower
from etfold.exir.passes.constant_prop.evaluate import evaluate
from etfold.exir.passes.constant_prop.name import fold_root, is_folded_target
from etfold.exir.passes.constant_prop.verdicts import SourcePolicy, constant_sources
from etfold.exir.passes.constant_prop_pass import FILLS_AND_QUANT_OPS, FOLD, fold_expression
from etfold.exir.passes.graph_walk import (
    NAME_DIGEST_LENGTH,
    constant_names,
    op_qualified_name,
    tensor_digest,
)
from etfold.exir.program.buffer_marks import BUFFER_FOLD_BLOCKERS
from etfold.harness.external_data import data_files, data_keys, load_with_data
from etfold.harness.xnnpack_runner import assert_close, export_method, load_program, lower_xnnpack

torch.manual_seed(0)


# --- helpers -----------------------------------------------------------------------------


def export(module: torch.nn.Module, *inputs) -> torch.export.ExportedProgram:
    return torch.export.export(module.eval(), inputs)


def eager(module, *inputs, method="forward"):
    with torch.no_grad():
        out = getattr(module, method)(*inputs)
    return [out] if isinstance(out, torch.Tensor) else list(out)


def run_module(ep, *inputs):
    out = ep.module()(*inputs)
    return [out] if isinstance(out, torch.Tensor) else list(out)


def on_xnnpack(ep, *inputs, method="forward"):
    lowered = lower_xnnpack({method: ep}, [XnnpackPartitioner()], lower=to_edge_transform_and_lower)
    return lowered, lowered.run(*inputs, method=method)


def ops(ep) -> list[str]:
    return [op_qualified_name(n.target) for n in ep.graph.nodes if n.op == "call_function"]


def declined(decisions) -> list[str]:
    return [d.detail for d in decisions if d.fold == FOLD and not d.applied]


def applied(decisions) -> list[str]:
    return [d.detail for d in decisions if d.fold == FOLD and d.applied]


def constant_only_nodes(ep, fold_buffers=True) -> list[str]:
    known, _ = constant_sources(ep, SourcePolicy(fold_buffers=fold_buffers))
    values = set(known)
    left = []
    for node in ep.graph.nodes:
        if node.op == "call_function" and all(p in values for p in node.all_input_nodes):
            values.add(node)
            left.append(node.name)
    return left


def new_placeholders(before, after) -> list[torch.fx.Node]:
    names = {n.name for n in before.graph.find_nodes(op="placeholder")}
    return [n for n in after.graph.find_nodes(op="placeholder") if n.name not in names]


def assert_declines(ep, inputs, reason, reference, **kwargs):
    """The pass leaves the graph as it was and says why."""
    before = str(ep.graph)
    with collect_decisions() as decisions:
        constant_prop_pass(ep, **kwargs)
    assert str(ep.graph) == before
    assert any(reason in r for r in declined(decisions)), declined(decisions)
    assert_close(run_module(ep, *inputs), reference, atol=1e-6)


class WeightExpr(torch.nn.Module):
    def __init__(self, n=8):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n, n))
        self.b = torch.nn.Parameter(torch.randn(n))

    def forward(self, x):
        return x @ (self.w * 2).t() + self.b.exp()


# --- 1. what folds, and the ops that never do ----------------------------------------------


def test_folds_parameter_expression_aten_and_runs_on_xnnpack():
    model, x = WeightExpr(), torch.randn(3, 8)
    ep = export(model, x)
    with collect_decisions() as decisions:
        constant_prop_pass(ep)
    assert constant_only_nodes(ep) == []
    assert sorted(ops(ep)) == ["aten.add.Tensor", "aten.matmul.default"]
    assert len(applied(decisions)) == 2
    assert_close(run_module(ep, x), eager(model, x), atol=1e-5)
    lowered, out = on_xnnpack(ep, x)
    assert lowered.delegates() == 1 and not lowered.ops_outside()
    assert_close(out, eager(model, x), atol=1e-4)


def test_folds_parameter_expression_edge_and_runs():
    model, x = WeightExpr(), torch.randn(3, 8)
    edge = to_edge(export(model, x))
    constant_prop_pass(edge.exported_program())
    ep = edge.exported_program()
    assert constant_only_nodes(ep) == []
    assert sorted(ops(ep)) == ["aten.add.Tensor", "aten.mm.default"]
    runtime = load_program(edge.to_executorch())
    assert_close(list(runtime.run_method("forward", (x,))), eager(model, x), atol=1e-5)


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x + self.w


def test_declines_when_impure():
    model, x = Plain(), torch.randn(4)
    ep = export(model, x)
    [w] = [n for n in ep.graph.find_nodes(op="placeholder") if n.name == "p_w"]
    with ep.graph.inserting_after(w):
        ep.graph.call_function(
            torch.ops.aten._assert_tensor_metadata.default, (w,), {"dtype": torch.float32}
        )
    ep.graph_module.recompile()
    assert_declines(ep, (x,), "impure op", eager(model, x))


class RandomAdd(torch.nn.Module):
    def forward(self, x):
        return x + torch.rand(4)


@pytest.mark.parametrize("dialect", ["aten", "edge"])
def test_declines_when_nondeterministic(dialect):
    x = torch.zeros(4)
    ep = export(RandomAdd(), x)
    if dialect == "edge":
        ep = to_edge(ep).exported_program()
    before = str(ep.graph)
    with collect_decisions() as decisions:
        constant_prop_pass(ep)
    assert str(ep.graph) == before and not ep.constants
    assert any("nondeterministic" in r for r in declined(decisions))
    module = ep.module()
    assert not torch.equal(module(x), module(x))  # still a fresh draw per call


def test_declines_when_memory_allocation():
    model, x = Plain(), torch.randn(4)
    edge = to_edge(export(model, x), compile_config=EdgeCompileConfig(_skip_dim_order=False))
    ep = edge.exported_program()
    [add] = ep.graph.find_nodes(op="call_function", target=exir_ops.edge.aten.add.Tensor)
    with ep.graph.inserting_before(add):
        alloc = ep.graph.call_function(memory.alloc, (((4,), torch.float32),))
        empty = ep.graph.call_function(torch.ops.aten.empty.memory_format, ([4],))
    alloc.meta["val"] = empty.meta["val"] = torch.empty(4, device="meta")
    ep.graph_module.recompile()
    before = str(ep.graph)
    with collect_decisions() as decisions:
        constant_prop_pass(ep)
    assert str(ep.graph) == before
    assert declined(decisions).count("memory allocation op") == 2
    ep.graph.erase_node(alloc)
    ep.graph.erase_node(empty)
    ep.graph_module.recompile()
    runtime = load_program(edge.to_executorch())
    assert_close(list(runtime.run_method("forward", (x,))), eager(model, x), atol=1e-6)


def test_declines_when_custom_skip_target():
    model, x = WeightExpr(), torch.randn(3, 8)
    ep = export(model, x)
    before = ops(ep)
    with collect_decisions() as decisions:
        constant_prop_pass(
            ep, custom_skip_targets={torch.ops.aten.mul.Tensor, torch.ops.aten.exp.default}
        )
    assert ops(ep) == before
    assert declined(decisions).count("in custom_skip_targets") == 2
    assert_close(run_module(ep, x), eager(model, x), atol=1e-5)


class Fill(torch.nn.Module):
    def __init__(self, make):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))
        self.make = make

    def forward(self, x):
        return x + self.make(self.w)


FILLS = {
    "full": lambda w: torch.full((4,), 0.5),
    "ones": lambda w: torch.ones(4),
    "zeros": lambda w: torch.zeros(4),
    "full_like": lambda w: torch.full_like(w, 2.0),
    "ones_like": lambda w: torch.ones_like(w),
    "new_zeros": lambda w: w.new_zeros(4),
    "fill": lambda w: torch.ops.aten.fill.Scalar(w, 3.0),
    "scalar_tensor": lambda w: torch.ops.aten.scalar_tensor.default(2.0),
}


@pytest.mark.parametrize("name", sorted(FILLS))
def test_declines_when_fill_factory(name):
    model, x = Fill(FILLS[name]), torch.randn(4)
    ep = export(model, x)
    assert any(name in op for op in ops(ep))
    assert_declines(
        ep,
        (x,),
        "factory op that only fills a tensor",
        eager(model, x),
        custom_skip_targets=FILLS_AND_QUANT_OPS,
    )


class DequantWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w_int", torch.randint(-100, 100, (4, 4), dtype=torch.int8))

    def forward(self, x):
        w = torch.ops.quantized_decomposed.dequantize_per_tensor.default(
            self.w_int, 0.05, 0, -128, 127, torch.int8
        )
        return torch.nn.functional.linear(x, w)


def test_declines_when_quant_primitive():
    model, x = DequantWeight(), torch.randn(2, 4)
    assert_declines(
        export(model, x),
        (x,),
        "quantization primitive",
        eager(model, x),
        custom_skip_targets=FILLS_AND_QUANT_OPS,
    )


def test_declines_when_evaluation_fails():
    model, x = Plain(), torch.randn(4)
    ep = export(model, x)
    [w] = [n for n in ep.graph.find_nodes(op="placeholder") if n.name == "p_w"]
    with ep.graph.inserting_after(w):
        ep.graph.call_function(torch.ops.aten.mm.default, (w, w))  # 1-D operands: mm raises
    ep.graph_module.recompile()
    before = str(ep.graph)
    with collect_decisions() as decisions:
        constant_prop_pass(ep)
    assert str(ep.graph) == before
    assert any(r.startswith("evaluation raised RuntimeError") for r in declined(decisions))
    ep.graph.erase_node(next(n for n in ep.graph.nodes if n.target is torch.ops.aten.mm.default))
    ep.graph_module.recompile()
    assert_close(run_module(ep, x), eager(model, x), atol=1e-6)


def test_declines_when_result_cannot_be_a_constant():
    model, x = Plain(), torch.randn(4)
    ep = export(model, x)
    [w] = [n for n in ep.graph.find_nodes(op="placeholder") if n.name == "p_w"]
    with ep.graph.inserting_after(w):
        text = ep.graph.call_function(repr, (w,))
    ep.graph_module.recompile()
    # the pass never runs a callable that is not an op (the weight fold's rule, now shared) ...
    assert_declines(ep, (x,), "<built-in function repr> is not an ATen op", eager(model, x))
    # ... and its evaluation phase keeps what a program cannot hold from becoming a constant
    found = evaluate(text, {w: ep.state_dict["w"]})
    assert found.reason == "result of type str cannot be held as a constant"


class Stateful(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.ones(4))

    def forward(self, x):
        y = x + self.state * 2
        self.state.add_(1)
        return y


def test_declines_when_buffer_written_in_place():
    model, x = Stateful(), torch.randn(4)
    ep = export(model, x)  # training IR keeps the in-place add_
    assert "aten.add_.Tensor" in ops(ep)
    assert_declines(
        ep,
        (x,),
        "`state` is written in this method (aten.add_.Tensor)",
        eager(copy.deepcopy(model), x),
    )


def test_declines_when_buffer_mutated():
    model, x = Stateful(), torch.randn(4)
    ep = export(model, x).run_decompositions({})  # functional: a BUFFER_MUTATION output
    assert ep.graph_signature.buffers_to_mutate
    assert_declines(
        ep,
        (x,),
        "`state` is written in this method (a functionalized mutation)",
        eager(copy.deepcopy(model), x),
    )


class Adapter(torch.nn.Module):
    """A LoRA-merged weight: base + A @ B."""

    def __init__(self, n=16, rank=2):
        super().__init__()
        self.base = torch.nn.Parameter(torch.randn(n, n))
        self.lora_a = torch.nn.Parameter(torch.randn(n, rank))
        self.lora_b = torch.nn.Parameter(torch.randn(rank, n))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.base + self.lora_a @ self.lora_b)


def tag(ep, tags: dict[str, str]):
    specs = {s.arg.name: s.target for s in ep.graph_signature.input_specs}
    for node in ep.graph.find_nodes(op="placeholder"):
        if specs.get(node.name) in tags:
            node.meta["custom"] = {"delegate_constant_tag": tags[specs[node.name]]}
    return ep


def test_declines_when_sources_disagree_on_custom():
    model, x = Adapter(), torch.randn(2, 16)
    ep = tag(export(model, x), {"base": "foundation", "lora_a": "lora", "lora_b": "lora"})
    with collect_decisions() as decisions:
        constant_prop_pass(ep, register_like_source=True)
    assert any("disagree on their `custom` meta" in r for r in declined(decisions))
    # the sum stays an op; the adapter product folds, tagged like its sources
    assert ops(ep) == ["aten.add.Tensor", "aten.linear.default"]
    [product] = [n for n in ep.graph.find_nodes(op="placeholder") if "_prop_" in n.name]
    assert product.meta["custom"] == {"delegate_constant_tag": "lora"}
    assert_close(run_module(ep, x), eager(model, x), atol=1e-4)


def test_declines_when_outside_allowlist():
    model, x = WeightExpr(), torch.randn(3, 8)
    ep = export(model, x)
    assert_declines(ep, (x,), "outside nodes_to_fold stay ops", eager(model, x), nodes_to_fold=[])


def test_declines_when_buffers_not_folded():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.rand(4) + 0.5)

        def forward(self, x):
            return x * self.scale.sqrt()

    model, x = Scaled(), torch.randn(4)
    assert_declines(
        export(model, x),
        (x,),
        "buffer scale (fold_buffers=False)",
        eager(model, x),
        fold_buffers=False,
    )


def _a_fold_name_and_its_data(model, x) -> tuple[str, torch.Tensor]:
    probe = constant_prop_pass(export(model, x), register_like_source=True)
    return next((t, v.detach()) for t, v in probe.state_dict.items() if "_prop_" in t)


def test_a_name_held_by_other_data_gives_the_fold_the_digested_name():
    model, x = WeightExpr(), torch.randn(3, 8)
    taken, folded = _a_fold_name_and_its_data(model, x)
    ep = export(model, x)
    other = torch.nn.Parameter(torch.zeros_like(folded), requires_grad=False)
    ep.state_dict[taken] = other
    constant_prop_pass(ep, register_like_source=True)
    renamed = constant_names(taken, folded)[1]
    assert renamed == f"{taken}_{tensor_digest(folded, NAME_DIGEST_LENGTH)}"
    assert ep.state_dict[taken] is other and torch.equal(ep.state_dict[renamed], folded)
    assert is_folded_target(renamed) and fold_root(renamed) == fold_root(taken)
    # the folded transpose is contiguous, eager's a view: the GEMMs sum in another order
    assert_close(run_module(ep, x), eager(model, x), atol=1e-5)


def test_declines_when_name_and_digested_name_are_held_by_other_data():
    model, x = WeightExpr(), torch.randn(3, 8)
    taken, folded = _a_fold_name_and_its_data(model, x)
    ep = export(model, x)
    for name in constant_names(taken, folded):
        ep.state_dict[name] = torch.nn.Parameter(torch.zeros_like(folded), requires_grad=False)
    assert_declines(
        ep,
        (x,),
        "already name constants with different data",
        eager(model, x),
        register_like_source=True,
    )


# --- 2. nodes_to_fold ----------------------------------------------------------------------


def test_only_allowlisted_nodes_fold():
    model, x = WeightExpr(), torch.randn(3, 8)
    ep = export(model, x)
    allowed = [n for n in ep.graph.nodes if str(n.target) in ("aten.mul.Tensor", "aten.t.default")]
    with collect_decisions() as decisions:
        constant_prop_pass(ep, nodes_to_fold=allowed, register_like_source=True)
    assert (
        "aten.exp.default" in ops(ep)
        and "aten.t.default" not in ops(ep)
        and "aten.mul.Tensor" not in ops(ep)
    )
    assert any("1 constant-only node(s) outside nodes_to_fold" in r for r in declined(decisions))
    assert len(applied(decisions)) == 1
    _, out = on_xnnpack(ep, x)
    assert_close(out, eager(model, x), atol=1e-4)


def test_allowlist_accepts_node_names():
    model, x = WeightExpr(), torch.randn(3, 8)
    ep = export(model, x)
    constant_prop_pass(ep, nodes_to_fold={"exp"})
    assert "aten.exp.default" not in ops(ep) and "aten.mul.Tensor" in ops(ep)
    assert_close(run_module(ep, x), eager(model, x), atol=1e-5)


# --- 3. fold_buffers=False -------------------------------------------------------------------


class WeightAndBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.register_buffer("gain", torch.rand(8) + 0.5)

    def forward(self, x):
        return x @ self.w.t() * self.gain.sqrt(), self.gain


def test_buffers_never_seed_a_fold_and_a_buffer_output_is_left_alone():
    model, x = WeightAndBuffer(), torch.randn(2, 8)
    ep = export(model, x)
    constant_prop_pass(ep, fold_buffers=False, register_like_source=True)
    assert "aten.t.default" not in ops(ep)
    assert "aten.sqrt.default" in ops(ep) and "aten.clone.default" not in ops(ep)
    assert ep.graph.output_node().args[0][1].name == "b_gain"
    lowered, out = on_xnnpack(ep, x)
    assert_close(out, eager(model, x), atol=1e-4)


def test_fold_buffers_true_folds_the_buffer_and_clones_it_as_output():
    model, x = WeightAndBuffer(), torch.randn(2, 8)
    ep = export(model, x)
    constant_prop_pass(ep)
    assert "aten.sqrt.default" not in ops(ep) and ops(ep).count("aten.clone.default") == 1
    _, out = on_xnnpack(ep, x)
    assert_close(out, eager(model, x), atol=1e-4)


class TwoBuffers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("gain", torch.rand(8) + 0.5)
        self.register_buffer("bias", torch.rand(8))

    def forward(self, x):
        return x * self.gain.sqrt() + self.bias


def _buffer_verdicts(ep, verdicts: dict) -> dict:
    """Each placeholder's cross-method verdict after setting `verdicts` on the sources."""
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in verdicts:
            node.meta[BUFFER_FOLD_BLOCKERS] = verdicts[node.name]
    constant_prop_pass(ep, register_like_source=True)
    return {
        n.name: n.meta.get(BUFFER_FOLD_BLOCKERS) for n in ep.graph.nodes if n.op == "placeholder"
    }


@pytest.mark.parametrize(
    ("sources", "folded"),
    [
        ({"b_gain": ()}, ()),
        ({"b_gain": ("method `update` may write it (aten.mul_.Tensor)",)}, None),
        ({}, None),
    ],
    ids=["judged", "judged-blocked", "never-judged"],
)
def test_a_folded_buffer_keeps_its_sources_verdict(sources, folded):
    """A buffer folded from judged buffers is judged as they were (a blocked one
    carries its reasons); from a buffer never judged, it is never judged either."""
    if folded is None and sources:
        folded = sources["b_gain"]
    model, x = TwoBuffers(), torch.randn(2, 8)
    ep = export(model, x)
    verdicts = _buffer_verdicts(ep, sources)
    (new,) = [name for name in verdicts if name.startswith("b_gain_prop_")]
    assert verdicts[new] == folded
    assert_close([ep.module()(x)], eager(model, x), atol=1e-6)


# --- 4. non-tensor results -------------------------------------------------------------------


class ScaledByMax(torch.nn.Module):
    def __init__(self, scalar_outside=False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.b = torch.nn.Parameter(torch.randn(4))
        self.scalar_outside = scalar_outside

    def forward(self, x):
        s = self.w.max().item()
        y = x + self.b * s
        return y * s if self.scalar_outside else y


def test_item_scalar_folds_into_one_add_at_edge():
    model, x = ScaledByMax(), torch.randn(4)
    edge = to_edge(export(model, x))
    ep = edge.exported_program()
    assert "aten._local_scalar_dense.default" in ops(ep)
    constant_prop_pass(ep)
    assert ops(ep) == ["aten.add.Tensor"]
    [add] = [n for n in ep.graph.nodes if n.op == "call_function"]
    constants = [
        a
        for a in add.args
        if a.op == "placeholder" and a.name in ep.graph_signature.inputs_to_lifted_tensor_constants
    ]
    assert len(constants) == 1 and len(ep.constants) == 1
    assert all(isinstance(v, torch.Tensor) for v in ep.constants.values())
    runtime = load_program(edge.to_executorch())
    assert_close(list(runtime.run_method("forward", (x,))), eager(model, x), atol=1e-5)


def test_scalar_read_inside_and_outside_the_fold_keeps_its_op():
    model, x = ScaledByMax(scalar_outside=True), torch.randn(4)
    ep = export(model, x)
    with collect_decisions() as decisions:
        constant_prop_pass(ep, register_like_source=True)
    assert ops(ep).count("aten.item.default") == 1
    assert "aten.max.default" not in ops(ep) and ops(ep).count("aten.mul.Tensor") == 1
    assert any(
        "non-tensor result (float) read outside the fold stays an op" in r
        for r in declined(decisions)
    )
    assert all(
        isinstance(v, torch.Tensor) for v in [*ep.state_dict.values(), *ep.constants.values()]
    )
    assert_close(run_module(ep, x), eager(model, x), atol=1e-5)


# --- 5. multi-output ops ----------------------------------------------------------------------


class MultiOut(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.kind = kind

    def forward(self, x):
        if self.kind == "split":
            a, b = self.w.split(4)
            w = torch.cat([b * 2, a])
        elif self.kind == "chunk":
            a, b = self.w.chunk(2, dim=1)
            w = torch.cat([a + b, a - b], dim=1)
        elif self.kind == "unbind":
            rows = self.w.unbind(0)
            w = torch.stack([r * (i + 1) for i, r in enumerate(rows)])
        else:  # max.dim: both outputs used, one of them an index tensor
            v, i = self.w.max(dim=1)
            return x @ self.w.t() + v + i.to(torch.float32)
        return x @ w.t()


@pytest.mark.parametrize("kind", ["split", "chunk", "unbind", "max_dim"])
def test_multi_output_op_folds_with_all_its_outputs(kind):
    model, x = MultiOut(kind), torch.randn(3, 8)
    ep = export(model, x)
    before = copy.deepcopy(ep)
    constant_prop_pass(ep, register_like_source=True)
    assert not any(n.target is operator.getitem for n in ep.graph.nodes)
    assert not any(kind.split("_")[0] in op for op in ops(ep))
    added = new_placeholders(before, ep)
    assert added and all(isinstance(n.meta["val"], torch.Tensor) for n in added)
    assert all(
        isinstance(ep.state_dict[ep.graph_signature.inputs_to_parameters[n.name]], torch.Tensor)
        for n in added
    )
    _, out = on_xnnpack(ep, x)
    assert_close(out, eager(model, x), atol=1e-4)


def test_multi_output_op_in_allowlist_brings_its_outputs():
    model, x = MultiOut("split"), torch.randn(3, 8)
    ep = export(model, x)
    allowed = [
        n
        for n in ep.graph.nodes
        if str(n.target) in ("aten.split.Tensor", "aten.mul.Tensor", "aten.cat.default")
    ]
    constant_prop_pass(ep, nodes_to_fold=allowed)
    assert not any(n.target is operator.getitem for n in ep.graph.nodes)
    assert_close(run_module(ep, x), eager(model, x), atol=1e-5)


# --- 6. naming -----------------------------------------------------------------------------------


class ParamAddCat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.rand(1, 2, 3))

    def forward(self, x):
        doubled = self.a + self.a
        stacked = torch.cat([self.a, doubled])
        return stacked * stacked + x


class ParamSlice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.rand(3, 2, 2))

    def forward(self, x):
        return torch.cat([x, torch.slice_copy(self.a, dim=0, start=0, end=1)])


class UnusedInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.rand(3, 2, 4))

    def forward(self, x, y):
        return x + self.a


class TwoFolds(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.rand(4, 4))
        self.register_buffer("b", torch.rand(4))

    def forward(self, x):
        return x @ self.a.t() + self.b.exp() + torch.tensor([1.0, 2.0, 3.0, 4.0]).log1p()


class NoUserInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("a", torch.ones(2))

    def forward(self):
        return torch.tensor([3.0, 4.0]) * self.a


class CastUnderCond(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.w = torch.randn(3, 3)

    def forward(self, pred, x):
        out = torch.nn.functional.linear(x, self.w.to(torch.float16).to(torch.float32))
        return torch.cond(pred, lambda v: self.linear(v) + 1, lambda v: self.linear(v) - 1, [out])


class ConvNoBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c = torch.rand(3, 3, 3)
        self.w = torch.rand(3, 3, 3)

    def forward(self, x):
        return (
            torch.ops.aten.convolution.default(self.c, self.w, None, [1], [0], [1], False, [0], 1)
            + x
        )


class ExpandSum(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x):
        return x + self.p.unsqueeze(1).expand(3, 5)


UPSTREAM_CASES = {
    "cast_under_cond_edge": (CastUnderCond, (torch.tensor(True), torch.randn(3, 3)), True),
    "conv_no_bias_edge": (ConvNoBias, (torch.randn(3, 3, 3),), True),
    "expand_zero_stride": (ExpandSum, (torch.randn(3, 5),), False),
    "param_add_cat": (ParamAddCat, (torch.zeros(2, 2, 3),), False),
    "param_slice": (ParamSlice, (torch.zeros(2, 2, 2),), False),
    "unused_input": (UnusedInput, (torch.zeros(3, 2, 4), torch.zeros(3, 2, 4)), False),
    "two_folds": (TwoFolds, (torch.randn(2, 4),), False),
    "two_folds_edge": (TwoFolds, (torch.randn(2, 4),), True),
    "no_user_inputs_edge": (NoUserInputs, (), True),
}


def layout(ep):
    specs = ep.graph_signature.input_specs
    return [
        (n.name, s.kind, s.target)
        for n, s in zip(ep.graph.find_nodes(op="placeholder"), specs, strict=True)
    ]


@pytest.mark.parametrize("case", sorted(UPSTREAM_CASES))
def test_default_mode_matches_upstream_names_kinds_and_order(case):
    build, inputs, at_edge = UPSTREAM_CASES[case]
    model = build()
    programs = []
    for run in (upstream_constant_prop_pass, constant_prop_pass):
        ep = export(model, *inputs)
        if at_edge:
            ep = to_edge(
                ep, compile_config=EdgeCompileConfig(_check_ir_validity=False)
            ).exported_program()
        programs.append(run(ep))
    theirs, ours = programs
    assert layout(ours) == layout(theirs)
    assert sorted(ours.constants) == sorted(theirs.constants)
    assert sorted(ours.state_dict) == sorted(theirs.state_dict)
    assert_close(run_module(ours, *inputs), eager(model, *inputs), atol=1e-6)


def test_register_like_source_name_is_source_then_expression_digest():
    model, x = WeightExpr(), torch.randn(3, 8)
    ep = export(model, x)
    sources, _ = constant_sources(ep)
    transpose = next(n for n in ep.graph.nodes if str(n.target) == "aten.t.default")
    expression, leaves = fold_expression(transpose, sources)
    assert [leaf.fqn for leaf in leaves] == ["w"]
    assert "aten.mul.Tensor(#0, 2)" in expression and "aten.t.default(#1)" in expression
    constant_prop_pass(ep, register_like_source=True)
    assert f"w_prop_{hashlib.sha256(expression.encode()).hexdigest()}" in ep.state_dict
    kinds = {s.target: s.kind for s in ep.graph_signature.input_specs}
    assert all(kinds[t] == InputKind.PARAMETER for t in kinds if t and "_prop_" in t)
    assert_close(run_module(ep, x), eager(model, x), atol=1e-5)


class ThreeMethods(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return x @ (self.w * 2).t()

    def again(self, x):
        return x @ (self.w * 2).t() + 1

    def other(self, x):
        return x @ (self.w * 3).t()


def test_three_methods_same_expression_same_name_different_expression_different_name():
    model, x = ThreeMethods().eval(), torch.randn(2, 8)
    programs = {m: export_method(model, m, (x,)) for m in ("forward", "again", "other")}
    names = {}
    for method, ep in programs.items():
        constant_prop_pass(ep, register_like_source=True)
        [names[method]] = [t for t in ep.state_dict if "_prop_" in t]
    assert names["forward"] == names["again"] != names["other"]
    assert all(n.startswith("w_prop_") for n in names.values())
    # through to_executorch with external constants: two entries, each method its own value
    edge = to_edge_transform_and_lower(programs, partitioner=[])
    executorch = edge.to_executorch(ExecutorchBackendConfig(external_constants=True))
    [blob] = data_files(executorch).values()
    assert data_keys(blob) == {names["forward"], names["other"]}
    runtime = load_with_data(executorch.buffer, data_files(executorch))
    for method in programs:
        assert_close(
            list(runtime.run_method(method, (x,))), eager(model, x, method=method), atol=1e-5
        )


def test_upstream_default_names_collide_across_methods():
    model, x = ThreeMethods().eval(), torch.randn(2, 8)
    names = {
        m: set(constant_prop_pass(export_method(model, m, (x,))).constants)
        for m in ("forward", "other")
    }
    assert names["forward"] == names["other"] == {"_prop_tensor_constant0"}


def test_expression_is_linear_in_nested_squarings():
    class Squarings(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.rand(4) * 0.1 + 0.95)

        def forward(self, x):
            w = self.w
            for _ in range(16):
                w = w * w
            return x + w

    model, x = Squarings(), torch.randn(4)
    ep = export(model, x)
    sources, _ = constant_sources(ep)
    last = [n for n in ep.graph.nodes if str(n.target) == "aten.mul.Tensor"][-1]
    expression, _ = fold_expression(last, sources)
    assert len(expression.splitlines()) == 1 + 16 + 1  # source, 16 producers, result
    assert len(expression) < 16 * 80
    constant_prop_pass(ep, register_like_source=True)
    assert_close(run_module(ep, x), eager(model, x), atol=1e-6)


class ScaledBase(torch.nn.Module):
    def __init__(self, n=16):
        super().__init__()
        self.base = torch.nn.Parameter(torch.randn(n, n))
        self.scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.base * self.scale)


def test_declines_when_a_tagged_source_meets_an_untagged_one():
    """The untagged scale lives in the program, the base in a shared file: folding would put
    program data into that file (the XNNPACK weight fold declines the same way)."""
    model, x = ScaledBase(), torch.randn(2, 16)
    ep = tag(export(model, x), {"base": "foundation"})
    assert_declines(
        ep,
        (x,),
        "`p_base` and `p_scale` disagree on their `custom` meta",
        eager(model, x),
        register_like_source=True,
    )
    assert ops(ep) == ["aten.mul.Tensor", "aten.linear.default"]


# --- 7. external-file tags -------------------------------------------------------------------------


def test_adapter_and_base_write_two_ptd_files_and_nothing_to_the_pte():
    model, x = Adapter(), torch.randn(2, 16)
    ep = tag(export(model, x), {"base": "foundation", "lora_a": "lora", "lora_b": "lora"})
    constant_prop_pass(ep, register_like_source=True)
    [product] = [t for t in ep.state_dict if "_prop_" in t]
    assert product.startswith("lora_a_prop_")
    edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])

    def tag_of(node):
        return (node.meta.get("custom") or {}).get("delegate_constant_tag")

    executorch = edge.to_executorch(ExecutorchBackendConfig(external_constants=tag_of))
    files = data_files(executorch)
    assert sorted(files) == ["foundation", "lora"]
    assert data_keys(files["foundation"]) == {"base"} and data_keys(files["lora"]) == {product}
    program = executorch.executorch_program
    assert (
        [len(b.storage) for b in program.constant_buffer] == [0]
        and not program.named_data
        and not program.segments
    )
    runtime = load_with_data(executorch.buffer, files)
    assert_close(list(runtime.run_method("forward", (x,))), eager(model, x), atol=1e-4)


def test_tagged_sources_that_agree_fold_with_their_tag():
    model, x = Adapter(), torch.randn(2, 16)
    tags = {"base": "adapter", "lora_a": "adapter", "lora_b": "adapter"}
    ep = tag(export(model, x), tags)
    constant_prop_pass(ep, register_like_source=True)
    assert ops(ep) == ["aten.linear.default"]
    [folded] = new_placeholders(tag(export(model, x), tags), ep)
    assert folded.meta["custom"] == {"delegate_constant_tag": "adapter"}
    assert ep.graph_signature.inputs_to_parameters[folded.name].startswith("base_prop_")
    assert_close(run_module(ep, x), eager(model, x), atol=1e-4)


# --- 8. detached results ---------------------------------------------------------------------------


class Views(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 6))

    def forward(self, x):
        return x @ self.w.t().contiguous().t(), self.w[:, :2].expand(3, 4, 2)


@pytest.mark.parametrize("like_source", [False, True])
def test_folded_results_are_detached_fresh_tensors(like_source):
    model, x = Views(), torch.randn(2, 4)
    ep = export(model, x)
    constant_prop_pass(ep, register_like_source=like_source)
    folded = [v for k, v in [*ep.state_dict.items(), *ep.constants.items()] if "_prop_" in k]
    assert len(folded) == 2
    param_storage = model.w.untyped_storage().data_ptr()
    for value in folded:
        assert not value.requires_grad and value.grad_fn is None and value.is_contiguous()
        assert value.untyped_storage().data_ptr() != param_storage and 0 not in value.stride()
    reference = [r.clone() for r in eager(model, x)]
    with torch.no_grad():
        model.w.add_(1.0)  # the user's module changes; the program must not
    assert_close(run_module(ep, x), reference, atol=1e-5)


# --- 9. placeholder placement and positional binding --------------------------------------------


class ThreeFoldsOneParam(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 6))
        self.v = torch.nn.Parameter(torch.randn(6))
        self.register_buffer("g", torch.rand(6) + 0.5)

    def forward(self, x):
        y = x @ self.w.t() + self.w.sum(0) * self.v
        return y * self.g + (self.w * 2).mean(1) + torch.tensor(1.5).exp()


def bind_by_position(ep, *inputs):
    values = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            continue
        values.append(
            ep.state_dict[spec.target]
            if spec.target in ep.state_dict
            else ep.constants[spec.target]
        )
    with torch.no_grad():
        return list(ep.graph_module(*values, *inputs))


@pytest.mark.parametrize("like_source", [False, True])
def test_three_folds_off_one_parameter_bind_by_position(like_source):
    model, x = ThreeFoldsOneParam(), torch.randn(2, 6)
    ep = export(model, x)
    constant_prop_pass(ep, register_like_source=like_source)
    kinds = [s.kind for s in ep.graph_signature.input_specs]
    assert kinds == sorted(
        kinds,
        key=lambda k: [
            InputKind.PARAMETER,
            InputKind.BUFFER,
            InputKind.CONSTANT_TENSOR,
            InputKind.USER_INPUT,
        ].index(k),
    )
    folded = [s.target for s in ep.graph_signature.input_specs if "_prop_" in (s.target or "")]
    assert len(folded) >= 3
    store = list(ep.state_dict) + list(ep.constants)
    assert [t for t in store if t in folded] == folded  # registered in placeholder (graph) order
    assert_close(bind_by_position(ep, x), eager(model, x), atol=1e-5)
    _, out = on_xnnpack(ep, x)
    assert_close(out, eager(model, x), atol=1e-4)


# --- 10. constant outputs go through a clone in the graph's dialect ----------------------------


class ReturnsConstant(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        return x + 1, self.w.t() * 2


@pytest.mark.parametrize(
    "dialect,clone",
    [
        ("aten", "aten.clone.default"),
        ("edge", "dim_order_ops._clone_dim_order.default"),
        ("edge_no_dim_order", "aten.clone.default"),
    ],
)
def test_constant_output_goes_through_a_clone_in_the_graph_dialect(dialect, clone):
    model, x = ReturnsConstant(), torch.randn(2)
    ep = export(model, x)
    if dialect == "aten":
        constant_prop_pass(ep)
        assert ops(ep) == ["aten.add.Tensor", clone]
        assert ep.graph.output_node().args[0][1].target is torch.ops.aten.clone.default
        _, out = on_xnnpack(ep, x)
    else:
        skip_dim_order = dialect == "edge_no_dim_order"
        edge = to_edge(ep, compile_config=EdgeCompileConfig(_skip_dim_order=skip_dim_order))
        constant_prop_pass(edge.exported_program(), _skip_dim_order=skip_dim_order)
        assert ops(edge.exported_program()) == ["aten.add.Tensor", clone]
        out = list(load_program(edge.to_executorch()).run_method("forward", (x,)))
    assert_close(out, eager(model, x), atol=1e-6)


# --- 11. iterative everywhere ---------------------------------------------------------------------


class Chain(torch.nn.Module):
    def __init__(self, length):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(4, 4))
        self.length = length

    def forward(self, x):
        w = self.w
        for i in range(self.length):
            w = w + 0.001 * (i % 3) if i % 2 else w * 0.999
        return x @ w


def test_long_chain_folds_without_recursion():
    model, x = Chain(600), torch.randn(2, 4)
    ep = export(model, x)
    assert len(ops(ep)) > 600
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 150)  # far below the chain's depth
    try:
        constant_prop_pass(ep, register_like_source=True)
    finally:
        sys.setrecursionlimit(limit)
    assert ops(ep) == ["aten.matmul.default"]
    assert_close(run_module(ep, x), eager(model, x), atol=1e-5)


# --- 12. a drop-in for upstream's pass ------------------------------------------------------------


def test_signature_keeps_upstreams_parameters_and_defaults():
    theirs = list(inspect.signature(upstream_constant_prop_pass).parameters.values())
    ours = list(inspect.signature(constant_prop_pass).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[: len(theirs)]] == [
        (p.name, p.kind, p.default) for p in theirs
    ]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[len(theirs) :])


def test_default_dequantizes_a_constant_weight_ahead_of_time_in_aten():
    model, x = DequantWeight(), torch.randn(2, 4)
    ep = export(model, x)
    assert "quantized_decomposed.dequantize_per_tensor.default" in ops(ep)
    with collect_decisions() as decisions:
        constant_prop_pass(ep)
    assert ops(ep) == ["aten.linear.default"]
    [weight] = ep.constants.values()
    assert weight.dtype == torch.float32 and len(applied(decisions)) == 1
    lowered, out = on_xnnpack(ep, x)
    assert lowered.delegates() == 1 and not lowered.ops_outside()
    assert_close(out, eager(model, x), atol=1e-4)


def test_default_keeps_edge_quantization_primitives():
    model, x = DequantWeight(), torch.randn(2, 4)
    ep = to_edge(
        export(model, x), compile_config=EdgeCompileConfig(_check_ir_validity=False)
    ).exported_program()
    before = str(ep.graph)
    with collect_decisions() as decisions:
        constant_prop_pass(ep)
    assert str(ep.graph) == before
    assert any(
        r == "quantized_decomposed.dequantize_per_tensor.default is a default skip target"
        for r in declined(decisions)
    )
    assert_close(run_module(ep, x), eager(model, x), atol=1e-6)


def test_default_keeps_edge_full_and_folds_aten_full():
    model, x = Fill(FILLS["full"]), torch.randn(4)
    edge = to_edge(export(model, x))
    before = str(edge.exported_program().graph)
    with collect_decisions() as decisions:
        constant_prop_pass(edge.exported_program())
    assert str(edge.exported_program().graph) == before
    assert "aten.full.default is a default skip target" in declined(decisions)
    runtime = load_program(edge.to_executorch())
    assert_close(list(runtime.run_method("forward", (x,))), eager(model, x), atol=1e-6)
    ep = export(model, x)
    constant_prop_pass(ep)
    assert ops(ep) == ["aten.add.Tensor"] and len(ep.constants) == 1
    _, out = on_xnnpack(ep, x)
    assert_close(out, eager(model, x), atol=1e-6)


def test_warns_on_control_flow_and_folds_outside_it(caplog):
    model, inputs = CastUnderCond(), (torch.tensor(True), torch.randn(3, 3))
    ep = export(model, *inputs)
    assert any(n.target is torch.ops.higher_order.cond for n in ep.graph.nodes)
    with caplog.at_level(logging.WARNING), collect_decisions() as decisions:
        constant_prop_pass(ep)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "constant_prop_pass does not constant propagate in control flow modules" in (
        warnings[0].getMessage()
    )
    assert "aten._to_copy.default" not in ops(ep) and applied(decisions)
    assert_close(run_module(ep, *inputs), eager(model, *inputs), atol=1e-6)


def test_program_without_placeholders_is_returned_untouched():
    class Literal(torch.nn.Module):
        def forward(self):
            return torch.ones(3) * 2

    model = Literal()
    ep = export(model)
    before = str(ep.graph)
    assert constant_prop_pass(ep) is ep and str(ep.graph) == before
    assert_close(run_module(ep), eager(model), atol=0)


WEIGHT_STEPS = {
    "scale": lambda w: w * 0.5,
    "transpose": lambda w: w.t(),
    "exp": lambda w: (w * 0.1).exp(),
    "add_self": lambda w: w + w,
    "row_sum": lambda w: w.sum(0, keepdim=True).expand_as(w),  # a zero-stride result
    "plus_ones": lambda w: w + torch.ones_like(w),  # a fill factory: folds by default
    "dequantize": lambda w: torch.ops.quantized_decomposed.dequantize_per_tensor.default(
        torch.ops.quantized_decomposed.quantize_per_tensor.default(
            w, 0.05, 0, -128, 127, torch.int8
        ),
        0.05,
        0,
        -128,
        127,
        torch.int8,
    ),
}


class GeneratedWeight(torch.nn.Module):
    def __init__(self, steps):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.steps = steps

    def forward(self, x):
        w = self.w
        for step in self.steps:
            w = WEIGHT_STEPS[step](w)
        return x @ w


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    steps=st.lists(st.sampled_from(sorted(WEIGHT_STEPS)), min_size=1, max_size=5),
    at_edge=st.booleans(),
)
def test_generated_weight_chains_fold_like_upstream(steps, at_edge):
    model, x = GeneratedWeight(steps), torch.randn(2, 4)
    programs = []
    for run in (upstream_constant_prop_pass, constant_prop_pass):
        ep = export(model, x)
        if at_edge:
            config = EdgeCompileConfig(_check_ir_validity=False)
            ep = to_edge(ep, compile_config=config).exported_program()
        programs.append(run(ep))
    theirs, ours = programs
    assert ops(ours) == ops(theirs)
    assert layout(ours) == layout(theirs)
    for name, value in ours.constants.items():
        assert value.is_contiguous() and torch.equal(value, theirs.constants[name])
    assert_close(run_module(ours, x), eager(model, x), atol=1e-5)
