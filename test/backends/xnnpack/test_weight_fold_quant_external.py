# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""XNNPACK weight fold beside quantized weights and external-file tags.

Q/DQ chains on weights stay exactly as they came; folded weights keep their
sources' external-file tag, so they land in the same `.ptd` file.
"""

from __future__ import annotations

import pytest
import torch
from executorch.exir import ExecutorchBackendConfig
from executorch.exir import to_edge_transform_and_lower as upstream_lower
from torch.nn.utils.parametrizations import weight_norm

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack.partition.weight_fold import FOLD
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower as etfold_lower
from etfold.harness.external_data import data_files, data_keys, load_with_data
from etfold.harness.xnnpack_runner import assert_close, eager_outputs, export_method, lower_xnnpack


def load_program_with_data(pte: bytes, ptd: bytes):
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    return _load_for_executorch_from_buffer(pte, ptd)


ATOL = 1e-4


def _outside(ops, op: str) -> bool:
    """`op` (any overload: `.default` at Edge, `.out` after emission) runs outside delegates."""
    return any(name.startswith(op + ".") for name in ops)


TAG = "delegate_constant_tag"


def _hook(program):
    return XnnpackPartitioner().transform_for_pre_decomposition(program)


def _applied(decisions) -> list[str]:
    return [d.where for d in decisions if d.fold == FOLD and d.applied]


def _declined(decisions) -> list[str]:
    return [d.detail for d in decisions if d.fold == FOLD and not d.applied]


# ---------------------------------------------------------------- quantized weights


class _QuantizedLinearBesideWeightNormConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = weight_norm(torch.nn.Conv1d(16, 16, 3, padding=1), dim=2)
        self.linear = torch.nn.Linear(64, 16)

    def forward(self, x, y):
        # independent branches: upstream XNNPACK fails on an fp32 conv fused with a neighbour's Q/DQ
        return self.linear(x), self.conv(y)


def _pt2e_quantized():
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    torch.manual_seed(0)
    module = _QuantizedLinearBesideWeightNormConv().eval()
    inputs = (torch.randn(2, 64), torch.randn(1, 16, 20))
    graph = torch.export.export(module, inputs).module()
    quantizer = XNNPACKQuantizer().set_module_type(
        torch.nn.Linear, get_symmetric_quantization_config(is_per_channel=True)
    )
    graph = prepare_pt2e(graph, quantizer)
    graph(*inputs)
    return convert_pt2e(graph), inputs


def _torchao_int4():
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    torch.manual_seed(0)
    module = _QuantizedLinearBesideWeightNormConv().eval()
    quantize_(
        module,
        Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(32)
        ),
        filter_fn=lambda m, fqn: fqn == "linear",
    )
    return module, (torch.randn(2, 64), torch.randn(1, 16, 20))


def _quant_nodes(program) -> list[tuple[str, tuple[str, ...]]]:
    found = []
    for node in program.graph.nodes:
        target = node.target
        if node.op == "call_function" and getattr(target, "namespace", None) in (
            "quantized_decomposed",
            "torchao",
        ):
            found.append((str(target), tuple(str(a) for a in node.args)))
    return found


@pytest.mark.parametrize(
    "build", [_pt2e_quantized, _torchao_int4], ids=["convert_pt2e", "torchao_int4_groupwise"]
)
def test_qdq_node_set_is_identical_while_a_float_weight_folds(build):
    module, inputs = build()
    program = torch.export.export(module, inputs)
    # what upstream's pipeline sees next without the hook (a torchao subclass weight is unwrapped there)
    expected = _quant_nodes(torch.export.export(module, inputs).run_decompositions({}))
    assert expected and len(expected) == len(_quant_nodes(program))
    with collect_decisions() as decisions:
        folded = _hook(program)
    assert _applied(decisions) == ["conv1d.weight"]
    assert any("quantization primitive" in r for r in _declined(decisions))
    assert _quant_nodes(folded) == expected

    lowered = lower_xnnpack(
        torch.export.export(module, inputs), [XnnpackPartitioner()], lower=etfold_lower
    )
    unhooked = lower_xnnpack(
        torch.export.export(module, inputs), [XnnpackPartitioner(fold_weights=False)]
    )
    assert _outside(unhooked.ops_outside(), "aten.convolution")
    assert not _outside(lowered.ops_outside(), "aten.convolution")
    assert_close(lowered.run(*inputs), unhooked.run(*inputs), atol=1e-3)
    assert_close(lowered.run(*inputs), eager_outputs(module, inputs), atol=0.1)


# ---------------------------------------------------------------- external-file tags


def _tag(program, tags: dict[str, str]):
    """Tag placeholders by FQN prefix, the way `delegate_external_constants_pass` tags get_attrs."""
    for spec in program.graph_signature.input_specs:
        if spec.target is None:
            continue
        for prefix, tag in tags.items():
            if spec.target.startswith(prefix):
                node = next(n for n in program.graph.nodes if n.name == spec.arg.name)
                node.meta["custom"] = {TAG: tag}
    return program


def _tag_of(node):
    return (node.meta.get("custom") or {}).get(TAG)


class _FoundationAndLora(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.base = weight_norm(torch.nn.Linear(16, 16))
        self.lora_w = torch.nn.Parameter(torch.randn(16, 16) / 4)
        self.lora_scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return self.base(x) + torch.nn.functional.linear(x, self.lora_w * self.lora_scale)


def test_foundation_and_lora_weights_land_in_their_ptd_files_and_nothing_in_the_pte():
    torch.manual_seed(0)
    module = _FoundationAndLora().eval()
    x = torch.randn(4, 16)
    program = _tag(torch.export.export(module, (x,)), {"base.": "foundation", "lora_": "lora"})
    with collect_decisions() as decisions:
        edge = etfold_lower(program, partitioner=[XnnpackPartitioner()])
    assert sorted(_applied(decisions)) == ["linear.weight", "linear_1.weight"]
    executorch = edge.to_executorch(ExecutorchBackendConfig(external_constants=_tag_of))
    files = data_files(executorch)
    assert sorted(files) == ["foundation", "lora"]
    # foundation: the folded weight and the bias; lora: the folded weight (scale and factors erased)
    assert len(data_keys(files["foundation"])) == 2
    assert len(data_keys(files["lora"])) == 1
    plan = executorch.executorch_program
    assert [len(b.storage) for b in plan.constant_buffer] == [0]
    assert not plan.named_data and not plan.segments
    assert (
        edge.exported_program().graph.find_nodes(
            op="call_function", target=torch.ops.aten.mul.Tensor
        )
        == []
    )
    runtime = load_with_data(executorch.buffer, files)
    assert_close(list(runtime.run_method("forward", (x,))), eager_outputs(module, (x,)), atol=ATOL)


class _MergedAdapter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.base = torch.nn.Parameter(torch.randn(16, 16) / 4)
        self.lora_a = torch.nn.Parameter(torch.randn(16, 2) / 4)
        self.lora_b = torch.nn.Parameter(torch.randn(2, 16) / 4)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.base + self.lora_a @ self.lora_b)


def test_declines_when_sources_disagree_on_their_external_tag():
    torch.manual_seed(0)
    module = _MergedAdapter().eval()
    x = torch.randn(4, 16)
    program = _tag(torch.export.export(module, (x,)), {"base": "foundation", "lora_": "lora"})
    with collect_decisions() as decisions:
        assert _hook(program) is program
    assert (
        len(_declined(decisions)) == 1
        and "disagree on their `custom` meta" in _declined(decisions)[0]
    )

    def lowered(fold_weights):
        program = _tag(torch.export.export(module, (x,)), {"base": "foundation", "lora_": "lora"})
        edge = etfold_lower(program, partitioner=[XnnpackPartitioner(fold_weights=fold_weights)])
        return edge.to_executorch(ExecutorchBackendConfig(external_constants=_tag_of))

    hooked, unhooked = lowered(True), lowered(False)
    assert hooked.buffer == unhooked.buffer
    assert data_files(hooked) == data_files(unhooked)
    assert sorted(data_files(hooked)) == ["foundation", "lora"]
    # Not run: executorch 1.5.1's runtime segfaults on this unfolded, tagged program with or
    # without the hook (tagged parameters feeding an XNNPACK delegate as inputs).


class _OneParameterTwoWays(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.w * 2)

    def same(self, x):
        return torch.nn.functional.linear(x, self.w * 2) + 1

    def other(self, x):
        return torch.nn.functional.linear(x, self.w.t() * 3)


def test_three_methods_reading_one_parameter_keep_it_one_external_entry():
    """Through upstream's entry point as through etfold's: a parameter several methods
    read stays one external entry, never folded into a copy per method."""
    torch.manual_seed(0)
    module = _OneParameterTwoWays().eval()
    x = torch.randn(4, 16)
    methods = ("forward", "same", "other")
    programs = {m: _tag(export_method(module, m, (x,)), {"w": "weights"}) for m in methods}
    with collect_decisions() as decisions:
        edge = upstream_lower(programs, partitioner=[XnnpackPartitioner()])
    assert _applied(decisions) == []
    declined = _declined(decisions)
    assert len(declined) >= 3 and all("read by several methods" in r for r in declined)
    executorch = edge.to_executorch(ExecutorchBackendConfig(external_constants=_tag_of))
    files = data_files(executorch)
    assert sorted(files) == ["weights"]
    assert data_keys(files["weights"]) == {"w"}
    runtime = load_program_with_data(executorch.buffer, files["weights"])
    for method in methods:
        expected = [getattr(module, method)(x).detach()]
        assert_close(list(runtime.run_method(method, (x,))), expected, atol=ATOL)
