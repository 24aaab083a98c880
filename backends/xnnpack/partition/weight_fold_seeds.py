# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.


"""Seeds of the XNNPACK weight fold: the values worth computing at export time.

    gemm(x, W(p...), b(q...))   W, b computed from constants -> seeds at gemm.weight, gemm.bias
    op(act, v(p...))            v constant-only, read by a runtime op -> a VALUE seed at v

Seeds are only the weight and bias arguments of the ops the enabled GEMM configs
partition, plus the constant frontier (constant-only tensors something computed
from user input reads: casts of parameters, rotary tables, masks from literals).
Whether a placeholder or an op may fold is `etfold.exir.passes.constant_prop.verdicts`'
answer, under the weight fold's policy: the cross-method marks count, fill
factories fold, quantization primitives stay.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from executorch.backends.xnnpack.partition.config.gemm_configs import (
    AddmmConfig,
    ConvolutionConfig,
    LinearConfig,
    MMConfig,
)
from executorch.backends.xnnpack.partition.config.xnnpack_config import ConfigPrecisionType
from torch.export import ExportedProgram

from etfold.decisions import Declined
from etfold.exir.passes.constant_prop.verdicts import (
    EVERY_METHOD,
    SkipFamilies,
    op_verdict,
    source_verdict,
)
from etfold.exir.passes.graph_walk import state_facts, state_placeholders
from etfold.exir.passes.node_shapes import node_value, rank_of

aten = torch.ops.aten

# factories fold (a fill stored once beats a fill per call); the Q/DQ chain stays as it came
WEIGHT_FOLD_OPS = SkipFamilies(fills=False, quantization=True)


@dataclass(frozen=True)
class GemmSlots:
    """Where a GEMM op takes its weight and bias (bias None: the op has none)."""

    weight: int
    bias: int | None
    weight_rank: int | None = None  # only seed when the weight has this rank


_CONV_OPS = (
    aten.conv1d,
    aten.conv2d,
    aten.conv3d,
    aten.conv_transpose1d,
    aten.conv_transpose2d,
    aten.conv_transpose3d,
    aten.convolution,
    aten._convolution,
)

# pre-decomposition ATen ops that decompose to what each upstream GEMM config partitions
_SLOTS_BY_CONFIG: dict[type, dict[torch._ops.OpOverloadPacket, GemmSlots]] = {
    LinearConfig: {aten.linear: GemmSlots(1, 2)},
    ConvolutionConfig: {op: GemmSlots(1, 2) for op in _CONV_OPS},
    AddmmConfig: {aten.addmm: GemmSlots(2, 0)},
    MMConfig: {aten.mm: GemmSlots(1, None), aten.matmul: GemmSlots(1, None, weight_rank=2)},
}


def seed_slots(configs: Iterable) -> dict[torch._ops.OpOverloadPacket, GemmSlots]:
    """GEMM ops whose weights are worth folding under these partitioner configs.

    A config counts when it partitions fp32 and requires static fp32 weights
    (`force_non_static_weights_for_f32_linear` asks for the weight to stay an input).
    """
    slots: dict[torch._ops.OpOverloadPacket, GemmSlots] = {}
    for config in configs:
        for config_type, ops in _SLOTS_BY_CONFIG.items():
            if type(config) is not config_type:
                continue
            if ConfigPrecisionType.FP32 not in config.enabled_precision_types:
                continue
            if (
                config_type is not ConvolutionConfig
                and config.force_non_static_weights_for_f32_linear
            ):
                continue
            slots.update(ops)
    return slots


VALUE = "value"  # a seed that is a constant-only tensor read by a runtime op, not a GEMM slot


@dataclass(frozen=True)
class Seed:
    gemm: torch.fx.Node  # for a VALUE seed, the seed node itself
    position: str  # "weight", "bias" or VALUE
    value: torch.fx.Node

    @property
    def where(self) -> str:
        return f"{self.gemm.name}.{self.position}"


def op_packet(node: torch.fx.Node):
    """The overload packet of an ATen op node (None for anything else)."""
    target = node.target
    return target.overloadpacket if isinstance(target, torch._ops.OpOverload) else None


_EXPORT_CHECKS = frozenset({aten._assert_tensor_metadata.default, aten._assert_scalar.default})


def is_export_check(node: torch.fx.Node) -> bool:
    """An assertion export left on a value's metadata: decided once the value is a constant."""
    return node.op == "call_function" and node.target in _EXPORT_CHECKS


def is_tensor_value(node: torch.fx.Node) -> bool:
    """A tensor, or a multi-output op's tensors (stored per output, never dropped to a scalar)."""
    value = node_value(node)
    values = value if isinstance(value, (list, tuple)) else [value]
    return bool(values) and all(isinstance(v, torch.Tensor) for v in values)


def find_seeds(program: ExportedProgram, slots: dict) -> list[Seed]:
    """Weight and bias arguments of seedable GEMM ops that are not already static state."""
    static = set(state_placeholders(program).values())
    seeds: list[Seed] = []
    for node in program.graph.nodes:
        if node.op != "call_function" or op_packet(node) not in slots:
            continue
        slot = slots[op_packet(node)]
        for position, index in (("weight", slot.weight), ("bias", slot.bias)):
            if (
                index is None
                or index >= len(node.args)
                or not isinstance(node.args[index], torch.fx.Node)
            ):
                continue
            value = node.args[index]
            if (
                position == "weight"
                and slot.weight_rank is not None
                and rank_of(value) != slot.weight_rank
            ):
                continue
            if value not in static:
                seeds.append(Seed(node, position, value))
    return seeds


def source_verdicts(program: ExportedProgram) -> Callable[[torch.fx.Node], Declined | None]:
    """Whether a placeholder may be folded from (None: it may), judged over the program once."""
    facts = state_facts(program)

    def verdict(node: torch.fx.Node) -> Declined | None:
        found = source_verdict(program, node, EVERY_METHOD, facts)
        if found is None:
            return Declined(f"computed from user input `{node.name}`")
        return found if isinstance(found, Declined) else None

    return verdict


def weight_fold_op_verdict(node: torch.fx.Node) -> Declined | None:
    """Whether an op may run at export time for the weight fold (None: it may)."""
    verdict = op_verdict(node, WEIGHT_FOLD_OPS)
    if verdict is None:
        return None
    return Declined(f"`{node.name}` ({node.target}): {verdict.reason}")


def constant_only_nodes(program: ExportedProgram) -> set[torch.fx.Node]:
    """Forward scan: nodes computed from foldable static state and literals alone."""
    source_verdict = source_verdicts(program)
    constant: set[torch.fx.Node] = set()
    for node in program.graph.nodes:
        if node.op == "placeholder":
            if source_verdict(node) is None:
                constant.add(node)
        elif weight_fold_op_verdict(node) is None and all(
            p in constant for p in node.all_input_nodes
        ):
            constant.add(node)
    return constant


def find_constant_frontier(program: ExportedProgram) -> list[Seed]:
    """Constant-only tensors that something computed from user input reads.

    Each is the root of a subgraph that would otherwise run on every call:
    casts of parameters, `1 + weight`, rotary tables, masks from literals.
    """
    constant = constant_only_nodes(program)
    return [
        Seed(node, VALUE, node)
        for node in program.graph.nodes
        if node in constant
        and node.op == "call_function"
        and is_tensor_value(node)
        and any(u not in constant and not is_export_check(u) for u in node.users)
    ]
