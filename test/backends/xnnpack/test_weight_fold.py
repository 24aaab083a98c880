# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""XNNPACK weight fold, single method: what folds, what stays an op, and why.

Every lowering runs on the XNNPACK runtime from the executorch wheel and is
compared with eager (or with the unhooked lowering where bytes must match).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from executorch.exir import to_edge_transform_and_lower as upstream_lower
from torch.nn.utils.parametrizations import weight_norm

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack.partition.weight_fold import FOLD
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower as etfold_lower
from etfold.harness.xnnpack_runner import (
    assert_close,
    eager_outputs,
    export_method,
    lower_module_xnnpack,
    lower_xnnpack,
)

ATOL = 1e-4


def _outside(ops, op: str) -> bool:
    """`op` (any overload: `.default` at Edge, `.out` after emission) runs outside delegates."""
    return any(name.startswith(op + ".") for name in ops)


def _hook(program, **kwargs):
    return XnnpackPartitioner(**kwargs).transform_for_pre_decomposition(program)


def _targets(program) -> Counter[str]:
    return Counter(str(n.target) for n in program.graph.nodes if n.op == "call_function")


def _lower_etfold(module, inputs, **partitioner_kwargs):
    return lower_module_xnnpack(
        module, inputs, [XnnpackPartitioner(**partitioner_kwargs)], lower=etfold_lower
    )


def _declined(decisions, where_prefix: str = "") -> list[str]:
    return [
        d.detail
        for d in decisions
        if d.fold == FOLD and not d.applied and d.where.startswith(where_prefix)
    ]


def _applied(decisions) -> list[str]:
    return [d.where for d in decisions if d.fold == FOLD and d.applied]


class _Linear(torch.nn.Module):
    """linear(x, weight_fn(self), bias) with a configurable weight expression."""

    def __init__(self, weight_fn, features: int = 16, bias: bool = True):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(features, features) / features**0.5)
        self.b = torch.nn.Parameter(torch.randn(features)) if bias else None
        self.weight_fn = weight_fn

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight_fn(self), self.b)


# ---------------------------------------------------------------- what folds


def test_weight_norm_conv1d_is_one_delegate_with_nothing_left_outside():
    torch.manual_seed(0)
    module = weight_norm(torch.nn.Conv1d(16, 16, 8, padding=4, groups=4), dim=2)
    x = torch.randn(1, 16, 40)
    with collect_decisions() as decisions:
        program, reference = _lower_etfold(module, (x,))
    stock, _ = lower_module_xnnpack(module, (x,))
    assert stock.delegates() >= 1 and _outside(stock.ops_outside(), "aten.convolution")
    assert program.delegates() == 1
    assert program.ops_outside() == Counter()
    assert _applied(decisions) == ["conv1d.weight"]
    assert_close(program.run(x), reference, atol=ATOL)


@pytest.mark.parametrize(
    "make, shape",
    [
        pytest.param(
            lambda: weight_norm(torch.nn.Conv2d(8, 16, 3, padding=1)), (1, 8, 10, 10), id="conv2d"
        ),
        pytest.param(
            lambda: weight_norm(torch.nn.ConvTranspose1d(8, 8, 4, stride=2), dim=1),
            (1, 8, 12),
            id="conv_transpose1d",
        ),
        pytest.param(lambda: weight_norm(torch.nn.Linear(16, 8)), (4, 16), id="linear"),
    ],
)
def test_weight_norm_gemms_fold_into_one_delegate(make, shape):
    torch.manual_seed(0)
    module = make()
    x = torch.randn(shape)
    program, reference = _lower_etfold(module, (x,))
    assert program.delegates() == 1
    assert program.ops_outside() == Counter()
    assert_close(program.run(x), reference, atol=ATOL)


class _WeightsBesideOtherParameterExpressions(torch.nn.Module):
    """Beside the linear's weight and bias: a mask from literals, an expanded parameter and
    a returned parameter expression, all constant-only and all read at runtime."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16) / 4)
        self.g = torch.nn.Parameter(torch.rand(16, 1) + 0.5)
        self.b = torch.nn.Parameter(torch.randn(16))
        self.offset = torch.nn.Parameter(torch.randn(16))
        self.derived = torch.nn.Parameter(torch.randn(4, 16))

    def forward(self, x):
        mask = (torch.arange(16) % 2).to(x.dtype)
        y = torch.nn.functional.linear(x * mask, self.w * self.g, self.b * 2)
        return y + self.offset.expand(x.shape[0], 16), self.derived.abs() + 1


def test_constant_only_work_folds_wherever_it_feeds():
    torch.manual_seed(0)
    module = _WeightsBesideOtherParameterExpressions().eval()
    x = torch.randn(4, 16)
    program = export_method(module, "forward", (x,))
    with collect_decisions() as decisions:
        folded = _hook(program)
    after = _targets(folded)
    assert {"linear.bias", "linear.weight"} <= set(_applied(decisions))
    for gone in ("aten.arange.default", "aten.expand.default", "aten.abs.default"):
        assert after[gone] == 0 < _targets(program)[gone], gone
    assert after["aten.mul.Tensor"] == 1  # x * mask reads the input
    lowered, reference = _lower_etfold(module, (x,))
    assert_close(lowered.run(x), reference, atol=ATOL)


@pytest.mark.parametrize(
    "weight_fn",
    [
        pytest.param(lambda m: torch.cat(torch.split(m.w, 4, dim=0)[::-1]), id="split"),
        pytest.param(
            lambda m: torch.cat([c * 2 for c in torch.chunk(m.w, 2, dim=1)], dim=1), id="chunk"
        ),
        pytest.param(lambda m: torch.stack([r.flip(0) for r in torch.unbind(m.w, 0)]), id="unbind"),
        pytest.param(
            lambda m: m.w / torch.max(m.w.abs(), dim=1, keepdim=True).values, id="max_dim"
        ),
    ],
)
def test_multi_output_ops_in_a_weight_expression_fold(weight_fn):
    torch.manual_seed(0)
    module = _Linear(weight_fn)
    x = torch.randn(4, 16)
    program, reference = _lower_etfold(module, (x,))
    assert program.delegates() == 1
    assert program.ops_outside() == Counter()
    assert_close(program.run(x), reference, atol=ATOL)


def test_a_600_op_weight_chain_folds_into_a_single_delegate():
    def chain(m):
        w = m.w
        for i in range(300):
            w = w * 1.001 if i % 2 else w + 0.0001
            w = w.t()
        return w

    torch.manual_seed(0)
    module = _Linear(chain)
    x = torch.randn(4, 16)
    program = export_method(module.eval(), "forward", (x,))
    assert sum(_targets(program).values()) >= 601
    lowered, reference = _lower_etfold(module, (x,))
    assert lowered.delegates() == 1
    assert lowered.ops_outside() == Counter()
    assert_close(lowered.run(x), reference, atol=ATOL)


def test_transposed_parameter_matmul_is_a_single_delegate():
    class TransposedMatmul(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 16))

        def forward(self, x):
            return x @ self.w.t()

    torch.manual_seed(0)
    module = TransposedMatmul()
    x = torch.randn(2, 3, 16)
    program, reference = _lower_etfold(module, (x,))
    assert program.delegates() == 1
    assert program.ops_outside() == Counter()
    assert_close(program.run(x), reference, atol=ATOL)


def test_weight_scaled_by_a_parameter_item_folds():
    class ItemScaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 16))
            self.scale = torch.nn.Parameter(torch.tensor(0.25))

        def forward(self, x):
            return torch.nn.functional.linear(x, self.w * self.scale.item())

    torch.manual_seed(0)
    module = ItemScaled()
    x = torch.randn(4, 16)
    folded = _hook(export_method(module.eval(), "forward", (x,)))
    assert _targets(folded)["aten.item.default"] == 0
    program, reference = _lower_etfold(module, (x,))
    assert program.delegates() == 1
    assert program.ops_outside() == Counter()
    assert_close(program.run(x), reference, atol=ATOL)


def test_a_scalar_read_inside_and_outside_the_fold_keeps_its_op():
    class ScalarTwice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 16))
            self.scale = torch.nn.Parameter(torch.tensor(0.5))

        def forward(self, x):
            s = self.scale.item()
            return torch.nn.functional.linear(x, self.w * s), x * s

    torch.manual_seed(0)
    module = ScalarTwice()
    x = torch.randn(4, 16)
    with collect_decisions() as decisions:
        folded = _hook(export_method(module.eval(), "forward", (x,)))
    assert _applied(decisions) == ["linear.weight"]
    after = _targets(folded)
    assert after["aten.item.default"] == 1
    assert after["aten.mul.Tensor"] == 1  # only x * s
    program, reference = _lower_etfold(module, (x,))
    assert_close(program.run(x), reference, atol=ATOL)


# ---------------------------------------------------------------- size rule


class _TiedEmbedding(torch.nn.Module):
    """Logits against a scaled copy of the embedding: computed from the shared table, the
    weight is the fold's (a re-layout alone would be `gemm_with_constant_operand_as_linear`'s)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)

    def forward(self, tokens):
        return self.embed(tokens) @ (self.embed.weight * 0.5).t()


class _TwoUseWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.w * 2) + torch.nn.functional.linear(x, self.w)


@pytest.mark.parametrize(
    "make, inputs",
    [
        pytest.param(_TiedEmbedding, lambda: (torch.tensor([[1, 5, 9]]),), id="tied_embedding"),
        pytest.param(_TwoUseWeight, lambda: (torch.randn(4, 16),), id="two_use_weight"),
    ],
)
def test_a_small_growing_fold_fits_the_growth_budget(make, inputs):
    torch.manual_seed(0)
    module = make().eval()
    args = inputs()
    program = export_method(module, "forward", args)
    with collect_decisions() as decisions:
        folded = _hook(program)
    assert _applied(decisions) and not _declined(decisions)
    assert folded is not program  # the fold grew the program and was applied
    lowered, reference = _lower_etfold(module, args)
    assert_close(lowered.run(*args), reference, atol=ATOL)


class _WideTwoUseWeight(torch.nn.Module):
    """Folding `w * 2` adds 256 KiB and erases nothing: past max(64 KiB, 1 % of 256 KiB)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(256, 256))

    def forward(self, x):
        # 2.0, a float32 number: an int would be lifted as a constant (a rewrite of its own)
        return torch.nn.functional.linear(x, self.w * 2.0) + torch.nn.functional.linear(x, self.w)


def test_declines_when_the_fold_would_grow_the_program_past_the_budget():
    torch.manual_seed(0)
    module = _WideTwoUseWeight().eval()
    args = (torch.randn(4, 256),)
    program = export_method(module, "forward", args)
    with collect_decisions() as decisions:
        assert _hook(program) is program
    assert any("past the 65536 B left of the growth budget" in r for r in _declined(decisions))
    hooked = lower_xnnpack(
        export_method(module, "forward", args), [XnnpackPartitioner()], lower=etfold_lower
    )
    unhooked = lower_xnnpack(
        export_method(module, "forward", args), [XnnpackPartitioner(fold_weights=False)]
    )
    assert hooked.executorch.buffer == unhooked.executorch.buffer
    assert_close(hooked.run(*args), eager_outputs(module, args), atol=1e-3)


# ---------------------------------------------------------------- same object, no retrace


def _quantized_linear():
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    torch.manual_seed(0)
    x = torch.randn(4, 16)
    graph = torch.export.export(torch.nn.Linear(16, 8).eval(), (x,)).module()
    quantizer = XNNPACKQuantizer().set_global(
        get_symmetric_quantization_config(is_per_channel=True)
    )
    graph = prepare_pt2e(graph, quantizer)
    graph(x)
    return convert_pt2e(graph), (x,)


class _WeightInput(torch.nn.Module):
    def forward(self, x, w):
        return torch.nn.functional.linear(x, w)


class _ActivationMatmul(torch.nn.Module):
    def forward(self, x, y):
        return x @ torch.relu(y)


@pytest.mark.parametrize(
    "build, reason",
    [
        pytest.param(_quantized_linear, "quantization primitive", id="quantized_linear"),
        pytest.param(
            lambda: (_WeightInput(), (torch.randn(4, 16), torch.randn(8, 16))),
            "user input",
            id="weight_is_an_input",
        ),
        pytest.param(
            lambda: (_ActivationMatmul(), (torch.randn(4, 16), torch.randn(16, 8))),
            "user input",
            id="matmul_of_activations",
        ),
    ],
)
def test_returns_the_same_program_without_retrace_when_nothing_folds(build, reason, monkeypatch):
    module, inputs = build()
    program = torch.export.export(module, inputs)
    calls = []
    original = torch.export.ExportedProgram.run_decompositions
    monkeypatch.setattr(
        torch.export.ExportedProgram,
        "run_decompositions",
        lambda self, *a, **k: calls.append(1) or original(self, *a, **k),
    )
    with collect_decisions() as decisions:
        assert _hook(program) is program
    assert calls == []
    assert any(reason in r for r in _declined(decisions))
    monkeypatch.undo()
    lowered = lower_xnnpack(
        torch.export.export(module, inputs), [XnnpackPartitioner()], lower=etfold_lower
    )
    assert_close(lowered.run(*inputs), eager_outputs(module, inputs), atol=0.05)


def test_functionalizes_once_before_folding(monkeypatch):
    torch.manual_seed(0)
    module = weight_norm(torch.nn.Linear(16, 8))
    program = export_method(module.eval(), "forward", (torch.randn(4, 16),))
    calls = []
    original = torch.export.ExportedProgram.run_decompositions
    monkeypatch.setattr(
        torch.export.ExportedProgram,
        "run_decompositions",
        lambda self, *a, **k: calls.append((a, k)) or original(self, *a, **k),
    )
    folded = _hook(program)
    assert folded is not program
    assert calls == [(({},), {})]
    assert "aten._weight_norm_interface.default" not in _targets(folded)
    assert "aten._weight_norm.default" not in _targets(folded)


def test_fold_weights_false_is_upstream_behaviour():
    torch.manual_seed(0)
    module = weight_norm(torch.nn.Linear(16, 8))
    program = export_method(module.eval(), "forward", (torch.randn(4, 16),))
    assert _hook(program, fold_weights=False) is program


# ---------------------------------------------------------------- factory ops and other declines


_FACTORIES = {
    "full": lambda m: torch.full((8, 16), 0.5),
    "new_full": lambda m: m.w.new_full((8, 16), 0.5),
    "ones": lambda m: torch.ones(8, 16),
    "new_ones": lambda m: m.w.new_ones((8, 16)),
    "zeros": lambda m: torch.zeros(8, 16),
    "new_zeros": lambda m: m.w.new_zeros((8, 16)),
    "full_like": lambda m: torch.full_like(m.w, 0.25),
    "ones_like": lambda m: torch.ones_like(m.w),
    "zeros_like": lambda m: torch.zeros_like(m.w),
}


class _FactoryWeight(torch.nn.Module):
    def __init__(self, factory):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 16))
        self.factory = factory

    def forward(self, x):
        return torch.nn.functional.linear(x, self.factory(self)) + self.w.sum()


@pytest.mark.parametrize("name", sorted(_FACTORIES))
def test_a_fill_factory_weight_folds(name):
    module = _FactoryWeight(_FACTORIES[name]).eval()
    x = torch.randn(4, 16)
    program = export_method(module, "forward", (x,))
    with collect_decisions() as decisions:
        folded = _hook(program)
    assert "linear.weight" in _applied(decisions)
    assert not any(str(t).startswith(f"aten.{name}.") for t in _targets(folded))
    lowered, reference = _lower_etfold(module, (x,))
    assert_close(lowered.run(x), reference, atol=ATOL)


def test_declines_when_the_weight_reads_a_nondeterministic_op():
    class RandomWeight(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 16))

        def forward(self, x):
            return torch.nn.functional.linear(x, self.w * torch.rand(8, 16).ge(2.0))

    module = RandomWeight().eval()
    x = torch.randn(4, 16)
    program = export_method(module, "forward", (x,))
    with collect_decisions() as decisions:
        assert _hook(program) is program
    assert any("nondeterministic op" in r for r in _declined(decisions, "linear.weight"))
    lowered, reference = _lower_etfold(module, (x,))
    assert_close(lowered.run(x), reference, atol=ATOL)


def test_declines_when_the_weight_depends_on_a_user_input():
    class InputScaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 16))

        def forward(self, x, s):
            return torch.nn.functional.linear(x, self.w * s)

    module = InputScaled().eval()
    inputs = (torch.randn(4, 16), torch.tensor(0.5))
    program = export_method(module, "forward", inputs)
    with collect_decisions() as decisions:
        assert _hook(program) is program
    assert _declined(decisions, "linear.weight") == [
        "weight stays dynamic: computed from user input `s`"
    ]
    lowered = lower_xnnpack(
        export_method(module, "forward", inputs), [XnnpackPartitioner()], lower=etfold_lower
    )
    assert_close(lowered.run(*inputs), eager_outputs(module, inputs), atol=ATOL)


def test_declines_when_the_program_is_for_training():
    from torch.export.experimental import _export_forward_backward

    class TrainLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = _Linear(lambda m: m.w * 2, features=4)
            self.loss = torch.nn.MSELoss()

        def forward(self, x, y):
            return self.loss(self.lin(x), y)

    torch.manual_seed(0)
    module = TrainLinear()
    inputs = (torch.randn(3, 4), torch.randn(3, 4))
    joint = _export_forward_backward(torch.export.export(module, inputs))
    assert joint.graph_signature.backward_signature is not None
    with collect_decisions() as decisions:
        hooked = _hook(joint)  # the bias gradient's sum may be written as a pooling
    assert hooked.state_dict.keys() == joint.state_dict.keys() and not hooked.constants
    assert [d.detail for d in decisions if d.fold == FOLD] == [
        "training program (backward signature): parameters stay trainable"
    ]
    parameters = {"lin.w", "lin.b"}
    edge = upstream_lower(joint, partitioner=[XnnpackPartitioner()])
    kept = {
        s.target
        for s in edge.exported_program().graph_signature.input_specs
        if s.kind.name == "PARAMETER"
    }
    assert kept >= parameters
    executorch = edge.to_executorch()
    plans = {plan.name for plan in executorch.executorch_program.execution_plan}
    assert "__et_training_parameters_index_forward" in plans
    from etfold.harness.xnnpack_runner import load_program

    loss = load_program(executorch).run_method("forward", inputs)[0]
    torch.testing.assert_close(loss, module(*inputs).detach(), atol=ATOL, rtol=0)


def test_declines_when_the_weight_comes_from_a_higher_order_op():
    class CondWeight(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 16))
            self.flag = torch.nn.Parameter(torch.tensor(1.0))

        def forward(self, x):
            w = torch.cond(self.flag > 0, lambda w: w * 2, lambda w: w * 3, (self.w,))
            return torch.nn.functional.linear(x, w)

    module = CondWeight().eval()
    x = torch.randn(4, 16)
    program = export_method(module, "forward", (x,))
    with collect_decisions() as decisions:
        _hook(program)
    assert any("is not an ATen op" in r for r in _declined(decisions, "linear.weight"))
    lowered, reference = _lower_etfold(module, (x,))
    assert_close(lowered.run(x), reference, atol=ATOL)


def test_one_computed_weight_read_by_two_gemms_folds_once():
    class SharedProjection(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = weight_norm(torch.nn.Linear(16, 16))

        def forward(self, x):
            return self.proj(torch.relu(self.proj(x)))

    torch.manual_seed(0)
    module = SharedProjection()
    x = torch.randn(4, 16)
    with collect_decisions() as decisions:
        folded = _hook(export_method(module.eval(), "forward", (x,)))
    assert sorted(_applied(decisions)) == ["linear.weight", "linear_1.weight"]
    added = [s.target for s in folded.graph_signature.input_specs if "_prop_" in (s.target or "")]
    assert len(added) == 1
    program, reference = _lower_etfold(module, (x,))
    assert program.delegates() == 1
    assert program.ops_outside() == Counter()
    assert_close(program.run(x), reference, atol=ATOL)
