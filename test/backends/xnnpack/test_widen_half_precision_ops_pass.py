"""fp16 GELU is computed in fp32 between two delegated converts."""

from collections import Counter

import pytest
import torch

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.widen_fp16_gelu_pass import (
    FOLD,
    match_fp16_gelu,
    widen_fp16_gelu,
)
from etfold.decisions import Declined, collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.xnnpack_runner import eager_outputs, lower_xnnpack

GELU = torch.ops.aten.gelu.default
TO_COPY = torch.ops.aten._to_copy.default


class GeluMlp(torch.nn.Module):
    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)
        self.approximate = approximate

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x), approximate=self.approximate))


def _model(dtype, approximate="none"):
    torch.manual_seed(0)
    module = GeluMlp(approximate).to(dtype).eval()
    return module, (torch.randn(4, 32).to(dtype),)


def _targets(program) -> Counter:
    return Counter(n.target for n in program.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_fp16_gelu_is_widened_and_computes_the_same_function(approximate):
    module, inputs = _model(torch.float16, approximate)
    program = torch.export.export(module, inputs)
    with collect_decisions() as decisions:
        widened = widen_fp16_gelu(program)
    assert widened is program
    (gelu,) = [n for n in program.graph.nodes if n.target is GELU]
    assert gelu.args[0].target is TO_COPY and gelu.args[0].kwargs["dtype"] is torch.float32
    assert gelu.meta["val"].dtype is torch.float32
    assert _targets(program)[TO_COPY] == 2
    assert [d.fold for d in decisions if d.applied] == [FOLD]
    # torch evaluates half GELU in fp32 and rounds once: bit-identical
    assert torch.equal(program.module()(*inputs), eager_outputs(module, inputs)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_dtypes_are_left_alone(dtype):
    module, inputs = _model(dtype)
    program = torch.export.export(module, inputs)
    before = str(program.graph)
    widen_fp16_gelu(program)
    assert str(program.graph) == before


def test_declines_when_the_gelu_input_has_no_metadata():
    module, inputs = _model(torch.float16)
    program = torch.export.export(module, inputs)
    (gelu,) = [n for n in program.graph.nodes if n.target is GELU]
    del gelu.args[0].meta["val"]
    assert match_fp16_gelu(gelu) == Declined("GELU input has no tensor metadata")
    before = str(program.graph)
    widen_fp16_gelu(program)
    assert str(program.graph) == before


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_fp16_mlp_lowers_to_one_delegate_and_matches_eager(approximate):
    module, inputs = _model(torch.float16, approximate)
    lowered = lower_xnnpack(
        torch.export.export(module, inputs),
        [XnnpackPartitioner()],
        lower=to_edge_transform_and_lower,
    )
    assert lowered.delegates() == 1
    assert sum(lowered.ops_outside().values()) == 0
    torch.testing.assert_close(
        lowered.run(*inputs)[0], eager_outputs(module, inputs)[0], atol=2e-3, rtol=2e-3
    )


def test_without_delegated_converts_the_gelu_stays_outside_as_upstream_leaves_it():
    module, inputs = _model(torch.float16)
    lowered = lower_xnnpack(
        torch.export.export(module, inputs),
        [XnnpackPartitioner(delegate_dtype_converts=False)],
        lower=to_edge_transform_and_lower,
    )
    assert lowered.delegates() == 2
    assert lowered.ops_outside() == {"aten.gelu.default": 1}
