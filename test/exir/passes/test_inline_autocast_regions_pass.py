# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Autocast and grad-mode regions are inlined before the folds: a program exported under
torch.autocast lowers like its explicitly cast twin."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from executorch.exir import to_edge_transform_and_lower as upstream_lower
from torch.export.graph_signature import ExportGraphSignature

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.decisions import Declined, collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.exir.passes.inline_autocast_regions_pass import (
    FOLD,
    INLINABLE_REGIONS,
    inline_autocast_regions,
    match_inlinable_regions,
)
from etfold.exir.program.method_marks import SHARED_ACROSS_METHODS
from etfold.harness.demo_lowerings import lowered_demo
from etfold.harness.xnnpack_runner import assert_close, lower_module_xnnpack

# Shares its decoder lowerings with the other readers of `lowered_demo`.

aten = torch.ops.aten
GEMMS = ("aten.linear.default", "aten.addmm.default", "aten.mm.default")


class AutocastMlp(torch.nn.Module):
    """fp32 weights; the GEMMs run in bf16 inside an autocast region, a no_grad region beside."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)

    def forward(self, x):
        with torch.no_grad():
            x = x * 2
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.down(torch.relu(self.up(x)))


class ExplicitlyCastMlp(AutocastMlp):
    """AutocastMlp with the casts autocast makes written out: bf16 GEMMs on bf16 copies."""

    def forward(self, x):
        with torch.no_grad():
            x = x * 2
        bf16 = torch.bfloat16
        up = torch.nn.functional.linear(x.to(bf16), self.up.weight.to(bf16), self.up.bias.to(bf16))
        down, bias = self.down.weight.to(bf16), self.down.bias.to(bf16)
        return torch.nn.functional.linear(torch.relu(up), down, bias)


def _regions(program) -> int:
    return sum(1 for n in program.graph.nodes if n.target in INLINABLE_REGIONS)


def _mlp(module_type: type[AutocastMlp] = AutocastMlp):
    torch.manual_seed(0)
    return module_type().eval(), (torch.randn(4, 32),)


def test_regions_are_inlined_with_autocast_casts_explicit():
    module, inputs = _mlp()
    program = torch.export.export(module, inputs)
    assert _regions(program) == 2
    with collect_decisions() as decisions:
        inlined = inline_autocast_regions(program)
    assert _regions(inlined) == 0 and _regions(program) == 2  # the input program is untouched
    casts = Counter(
        n.args[0].name
        for n in inlined.graph.nodes
        if n.target is aten._to_copy.default and n.kwargs.get("dtype") is torch.bfloat16
    )
    assert {"p_up_weight", "p_up_bias", "p_down_weight", "p_down_bias"} <= set(casts)
    (applied,) = [d for d in decisions if d.fold == FOLD]
    assert applied.applied and "autocast(cpu, torch.bfloat16, enabled=True)" in applied.detail
    assert "set_grad_enabled(False)" in applied.detail
    torch.testing.assert_close(inlined.module()(*inputs), module(*inputs), atol=0, rtol=0)


def test_placeholder_marks_survive_inlining():
    module, inputs = _mlp()
    program = torch.export.export(module, inputs)
    (weight,) = [n for n in program.graph.nodes if n.name == "p_up_weight"]
    weight.meta[SHARED_ACROSS_METHODS] = True
    inlined = inline_autocast_regions(program)
    (weight,) = [n for n in inlined.graph.nodes if n.name == "p_up_weight"]
    assert weight.meta.get(SHARED_ACROSS_METHODS) is True


def test_a_program_without_regions_comes_back_as_the_same_object():
    torch.manual_seed(0)
    program = torch.export.export(torch.nn.Linear(4, 4).eval(), (torch.randn(2, 4),))
    with collect_decisions() as decisions:
        assert inline_autocast_regions(program) is program
    assert match_inlinable_regions(program) is None and not decisions


def test_declines_when_the_program_is_a_training_program(monkeypatch):
    module, inputs = _mlp()
    program = torch.export.export(module, inputs)
    monkeypatch.setattr(ExportGraphSignature, "backward_signature", property(lambda s: object()))
    before = str(program.graph)
    reason = "training program (backward signature): regions stay for autograd"
    assert match_inlinable_regions(program) == Declined(reason)
    with collect_decisions() as decisions:
        assert inline_autocast_regions(program) is program
    assert str(program.graph) == before
    assert [(d.applied, d.detail) for d in decisions] == [(False, reason)]


def test_autocast_mlp_lowers_to_one_delegate_and_matches_eager():
    module, inputs = _mlp()
    lowered, expected = lower_module_xnnpack(
        module, inputs, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
    )
    assert lowered.delegates() == 1 and not any(lowered.ops_outside()[op] for op in GEMMS)
    assert_close(lowered.run(*inputs), expected, atol=2e-2, rtol=2e-2)


def test_the_autocast_mlp_lowers_like_its_explicitly_cast_twin():
    lowered = {}
    for module_type in (AutocastMlp, ExplicitlyCastMlp):
        module, inputs = _mlp(module_type)
        lowered[module_type], expected = lower_module_xnnpack(
            module, inputs, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
        )
        assert_close(lowered[module_type].run(*inputs), expected, atol=2e-2, rtol=2e-2)
    autocast, explicit = lowered[AutocastMlp], lowered[ExplicitlyCastMlp]
    assert autocast.delegates() == explicit.delegates()
    assert sum(autocast.ops_outside().values()) <= sum(explicit.ops_outside().values())


# The report's decoders, each a decoder lowering, in `make test-long`: the MLP pair above
# proves the pairing in `make test`.
@pytest.fixture(scope="module")
def decoders():
    """The report's two decoder rows, lowered once for every test file that reads them (one worker runs those files)."""
    return {cast: lowered_demo(f"decoder_{cast}_bf16") for cast in ("autocast", "explicit")}


@pytest.mark.long
def test_the_autocast_decoder_lowers_like_its_explicitly_cast_twin(decoders):
    autocast = decoders["autocast"].program
    explicit = decoders["explicit"].program
    assert autocast.delegates() == explicit.delegates()
    assert not any(autocast.ops_outside()[op] for op in GEMMS)
    assert sum(autocast.ops_outside().values()) <= sum(explicit.ops_outside().values()) + 1


@pytest.mark.long
@pytest.mark.parametrize("cast", ["autocast", "explicit"])
def test_decoders_match_eager_on_the_runtime(decoders, cast):
    lowering = decoders[cast]
    assert_close(lowering.program.run(*lowering.inputs), lowering.expected, atol=5e-2, rtol=2e-2)


def test_stock_leaves_the_autocast_gemms_on_portable():
    module, inputs = _mlp()
    stock, _ = lower_module_xnnpack(
        module, inputs, [UpstreamXnnpackPartitioner()], lower=upstream_lower
    )
    assert sum(stock.ops_outside()[op] for op in GEMMS) == 2
