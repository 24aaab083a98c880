# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Which copies etfold's XnnpackPartitioner delegates as converts, and why it declines the rest.

One `test_declines_when_…` per precondition: the copy stays outside the
delegates as the same op, the reason is recorded, and the program still runs
equal to eager.
"""

from __future__ import annotations

import logging

import pytest
import torch
from executorch.backends.xnnpack.partition.config.generic_node_configs import ToDimOrderCopyConfig
from executorch.backends.xnnpack.partition.config.xnnpack_config import ConfigPrecisionType
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from executorch.exir import EdgeCompileConfig, to_edge, to_edge_transform_and_lower

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack._passes.dtype_convert_match import (
    FOLD,
    DtypeConvert,
    is_copy,
    match_dtype_convert,
)
from etfold.backends.xnnpack._passes.rewrite_dtype_copies_as_converts_pass import (
    RewriteDtypeCopiesAsConvertsPass,
    UnsupportedDtypeCopyError,
)
from etfold.backends.xnnpack.install import DTYPE_CONVERTS_SPEC
from etfold.backends.xnnpack.partition.config.convert_config import (
    DtypeConvertingToCopyConfig,
    DtypeConvertingToDimOrderCopyConfig,
)
from etfold.decisions import Declined, collect_decisions
from etfold.harness.inspection import lowered_modules, ops_outside_delegates
from etfold.harness.xnnpack_runner import lower_module_xnnpack

SKIP_DIM_ORDER = EdgeCompileConfig(_skip_dim_order=True)


class Convert(torch.nn.Module):
    def __init__(self, dtype: torch.dtype, memory_format=None):
        super().__init__()
        self.dtype = dtype
        self.memory_format = memory_format

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.memory_format is None:
            return x.to(self.dtype)
        return x.to(self.dtype, memory_format=self.memory_format)


class ScaleByBuffer(torch.nn.Module):
    """x (bf16) * scale, with the fp32 buffer cast to bf16 in the graph."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.to(torch.bfloat16)


def _copies_outside(program) -> int:
    return sum(
        n
        for op, n in program.ops_outside().items()
        if "to_dim_order_copy" in op or "_to_copy" in op
    )


def _declined(decisions) -> list[str]:
    return [d.detail for d in decisions if d.fold == FOLD and not d.applied]


def _applied(decisions) -> list[str]:
    return [d.detail for d in decisions if d.fold == FOLD and d.applied]


def _lower(module, inputs, partitioner=None, **kwargs):
    partitioner = partitioner or XnnpackPartitioner(enable_bf16=True, fold_weights=False)
    with collect_decisions() as decisions:
        program, expected = lower_module_xnnpack(module, inputs, [partitioner], **kwargs)
    return program, expected, decisions


def _assert_declined(program, expected, decisions, inputs, reason_part, copies=1):
    assert _copies_outside(program) == copies
    assert not _applied(decisions)
    assert any(reason_part in reason for reason in _declined(decisions)), _declined(decisions)
    actual = program.run(*inputs)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)


@pytest.mark.parametrize(
    "source,target,compile_config",
    [(torch.float16, torch.bfloat16, None), (torch.bfloat16, torch.float16, SKIP_DIM_ORDER)],
    ids=["fp16_bf16_dim_order", "bf16_fp16_skip_dim_order"],
)
def test_declines_when_not_to_or_from_fp32(source, target, compile_config):
    x = torch.randn(3, 5).to(source)
    program, expected, decisions = _lower(Convert(target), (x,), compile_config=compile_config)
    assert program.delegates() == 0
    _assert_declined(program, expected, decisions, (x,), "only float32 <-> float16/bfloat16")


def test_declines_when_dtype_and_layout_change_at_once():
    x = torch.randn(1, 3, 4, 4)
    module = Convert(torch.float16, memory_format=torch.channels_last)
    program, expected, decisions = _lower(module, (x,))
    _assert_declined(program, expected, decisions, (x,), "changes dtype and layout at once")


def test_declines_when_dtype_and_layout_change_at_once_without_dim_order():
    # ExecuTorch's emitter cannot serialize a channels_last `_to_copy`, so this
    # stops at the lowered edge program
    x = torch.randn(1, 3, 4, 4)
    module = Convert(torch.float16, memory_format=torch.channels_last)
    partitioner = XnnpackPartitioner(fold_weights=False)
    with collect_decisions() as decisions:
        edge = to_edge_transform_and_lower(
            torch.export.export(module, (x,)),
            partitioner=[partitioner],
            compile_config=SKIP_DIM_ORDER,
        )
    assert ops_outside_delegates(edge.exported_program()) == {"aten._to_copy.default": 1}
    assert _declined(decisions) == ["the copy changes dtype and layout at once"]


def test_declines_when_converting_a_constant():
    x = torch.randn(2, 8).to(torch.bfloat16)
    program, expected, decisions = _lower(ScaleByBuffer(), (x,))
    assert program.delegates() == 1  # the multiply is delegated, the buffer cast is not
    _assert_declined(program, expected, decisions, (x,), "converts a constant")


def test_declines_when_bf16_is_not_enabled():
    x = torch.randn(3, 5)
    partitioner = XnnpackPartitioner(fold_weights=False, enable_bf16=False)
    program, expected, decisions = _lower(Convert(torch.bfloat16), (x,), partitioner)
    _assert_declined(program, expected, decisions, (x,), "enable_bf16=True")


def test_declines_when_fp32_precision_is_not_enabled():
    x = torch.randn(3, 5)
    partitioner = XnnpackPartitioner(
        config_precisions=ConfigPrecisionType.STATIC_QUANT, fold_weights=False
    )
    program, expected, decisions = _lower(Convert(torch.float16), (x,), partitioner)
    _assert_declined(program, expected, decisions, (x,), "FP32 precision is not enabled")


def test_declines_when_xnnpack_common_constraints_fail():
    x = torch.randn(3, 0)  # XNNPACK takes no empty tensors
    program, expected, decisions = _lower(Convert(torch.float16), (x,))
    _assert_declined(program, expected, decisions, (x,), "common constraints")


def test_decline_reason_also_goes_through_upstream_why(caplog):
    x = torch.randn(3, 5).to(torch.float16)
    logger = "etfold.backends.xnnpack.partition.config.convert_config"
    with caplog.at_level(logging.DEBUG, logger=logger):
        _lower(Convert(torch.bfloat16), (x,))
    assert any(
        "WhyNoPartition" in r.getMessage() and "only float32 <-> float16/bfloat16" in r.getMessage()
        for r in caplog.records
    )


def test_delegate_dtype_converts_false_is_upstream_partitioning():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), Convert(torch.float16)).eval()
    x = torch.randn(2, 8)
    etfold_off = XnnpackPartitioner(delegate_dtype_converts=False, fold_weights=False)
    off, _, decisions = _lower(module, (x,), etfold_off)
    upstream, _, _ = _lower(module, (x,), UpstreamXnnpackPartitioner())
    assert _copies_outside(off) == 1 and not decisions
    assert off.executorch.buffer == upstream.executorch.buffer
    assert DTYPE_CONVERTS_SPEC not in etfold_off.delegation_spec.compile_specs
    assert "_to_copy.default" not in etfold_off.target_partitioner_configs


def test_configs_swap_upstreams_copy_config_and_leave_the_delegation_spec():
    partitioner = XnnpackPartitioner(fold_weights=False)
    configs = partitioner.target_partitioner_configs
    assert type(configs["_to_dim_order_copy.default"]) is DtypeConvertingToDimOrderCopyConfig
    assert type(configs["_to_copy.default"]) is DtypeConvertingToCopyConfig
    assert partitioner.delegation_spec.compile_specs == []  # marked per partition
    explicit = XnnpackPartitioner(configs=[ToDimOrderCopyConfig], fold_weights=False)
    assert set(explicit.target_partitioner_configs) == {
        "_to_dim_order_copy.default",
        "_to_copy.default",
    }


class ChannelsLastConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.to(memory_format=torch.channels_last))


def test_memory_format_only_copies_serialize_exactly_as_upstream():
    torch.manual_seed(0)
    module, x = ChannelsLastConv().eval(), torch.randn(1, 3, 6, 6)
    ours, expected, decisions = _lower(module, (x,))
    upstream, _, _ = _lower(module, (x,), UpstreamXnnpackPartitioner())
    assert not decisions
    ours_blobs = [m.processed_bytes for m in lowered_modules(ours.edge.exported_program())]
    upstream_blobs = [m.processed_bytes for m in lowered_modules(upstream.edge.exported_program())]
    assert ours_blobs == upstream_blobs and len(ours_blobs) == 1
    torch.testing.assert_close(ours.run(x)[0], expected[0])


def _edge_copy_node(module, x, compile_config=None):
    edge = to_edge(torch.export.export(module, (x,)), compile_config=compile_config)
    graph_module = edge.exported_program().graph_module
    return graph_module, next(n for n in graph_module.graph.nodes if is_copy(n))


def test_matcher_declines_when_not_a_copy():
    graph_module, copy = _edge_copy_node(Convert(torch.float16), torch.randn(2, 3))
    placeholder = next(iter(graph_module.graph.nodes))
    assert match_dtype_convert(placeholder) == Declined("not a _to_copy or _to_dim_order_copy")
    assert isinstance(match_dtype_convert(copy), DtypeConvert)


def test_matcher_declines_when_metadata_is_missing():
    _, copy = _edge_copy_node(Convert(torch.float16), torch.randn(2, 3))
    del copy.meta["val"]
    assert match_dtype_convert(copy) == Declined("no tensor metadata on the copy or its input")


def test_matcher_declines_when_the_copy_keeps_its_dtype():
    _, copy = _edge_copy_node(ChannelsLastConv(), torch.randn(1, 3, 6, 6))
    assert match_dtype_convert(copy) == Declined("the copy keeps its dtype")


@pytest.mark.parametrize(
    "compile_config", [None, SKIP_DIM_ORDER], ids=["dim_order", "skip_dim_order"]
)
def test_preprocess_rewrite_refuses_a_copy_xnnpack_cannot_convert(compile_config):
    x = torch.randn(2, 3).to(torch.float16)
    graph_module, copy = _edge_copy_node(Convert(torch.bfloat16), x, compile_config)
    before = str(graph_module.graph)
    with pytest.raises(UnsupportedDtypeCopyError, match="only float32 <-> float16/bfloat16"):
        RewriteDtypeCopiesAsConvertsPass()(graph_module)
    assert str(graph_module.graph) == before


@pytest.mark.parametrize(
    "compile_config", [None, SKIP_DIM_ORDER], ids=["dim_order", "skip_dim_order"]
)
def test_preprocess_rewrite_turns_the_copy_into_a_convert_in_place(compile_config):
    graph_module, copy = _edge_copy_node(Convert(torch.bfloat16), torch.randn(2, 3), compile_config)
    name = copy.name
    with collect_decisions() as decisions:
        result = RewriteDtypeCopiesAsConvertsPass()(graph_module)
    assert result.modified
    assert copy.name == name and copy.kwargs == {}
    assert copy.target.__name__ == "prims.convert_element_type.default"
    assert copy.args[1] == torch.bfloat16
    assert _applied(decisions) == ["float32 -> bfloat16"]


class DequantizeThenHalf(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)

        ops = torch.ops.quantized_decomposed
        q = ops.quantize_per_tensor.default(x, 0.05, 0, -128, 127, torch.int8)
        return ops.dequantize_per_tensor.default(q, 0.05, 0, -128, 127, torch.int8).half()


def test_declines_when_the_copy_touches_quantization():
    x = torch.randn(4, 8)
    program, expected, decisions = _lower(DequantizeThenHalf(), (x,))
    _assert_declined(
        program, expected, decisions, (x,), "reads a dequantize or feeds a quantize node"
    )


def test_a_delegated_convert_serializes_as_one_xnnconvert_node(monkeypatch):
    from executorch.backends.xnnpack.serialization.xnnpack_graph_schema import XNNConvert

    from etfold.backends.xnnpack.operators.op_convert import XNNConvertVisitor

    serialized = []
    define_node = XNNConvertVisitor.define_node

    def spy(self, node, xnn_graph, vals_to_ids, debug_handle):
        define_node(self, node, xnn_graph, vals_to_ids, debug_handle)
        serialized.append(xnn_graph.xnodes[-1].xnode_union)

    monkeypatch.setattr(XNNConvertVisitor, "define_node", spy)
    x = torch.randn(2, 6)
    program, expected, _ = _lower(Convert(torch.bfloat16), (x,))
    assert [type(n) for n in serialized] == [XNNConvert]
    assert serialized[0].input_id != serialized[0].output_id
    assert torch.equal(program.run(x)[0], expected[0])
