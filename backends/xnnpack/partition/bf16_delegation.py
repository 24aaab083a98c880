# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Whether a program's bf16 work is offered to XNNPACK, and saying so when it is not.

    enable_bf16 unset,  program computes in bf16  -> bf16 enabled on the configs whose
                                                     XNNPACK kernel runs bf16
    enable_bf16 unset,  no bf16 in the program    -> upstream's default (off): nothing changes
    enable_bf16=False,  bf16 GEMMs in the program -> decline at WARNING naming the GEMMs
    enable_bf16=True                              -> upstream's behaviour, except for the ops
                                                     XNNPACK cannot run in bf16 (declined)

Upstream keeps bf16 off unless asked, so a bf16 decoder silently runs its GEMMs on
portable kernels. With bf16 on, upstream's configs also accept ops whose bf16
kernel XNNPACK lacks (convolution, bmm, softmax, pooling, mean, bilinear
upsampling): the delegate then fails to compile when the program loads. Those
stay on portable kernels, with a WARNING naming them. Settings are scoped to one
`partition()` call: the configs carry the user's setting again afterwards, so one
partitioner can lower fp32 and bf16 programs alike.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from etfold.decisions import Declined, record_applied, record_declined
from etfold.exir.passes.graph_walk import op_qualified_name
from etfold.exir.passes.node_shapes import node_value

FOLD = "xnnpack.bf16_delegation"

# GEMMs that upstream's configs delegate once bf16 is enabled (edge ops, before lowering)
_GEMM_OPS = frozenset(
    {
        "aten.linear.default",
        "aten.addmm.default",
        "aten.mm.default",
        "aten.bmm.default",
        "aten.convolution.default",
    }
)


# Upstream config target -> whether a bf16 delegate holding it compiles and matches eager on
# the executorch 1.5.1 XNNPACK runtime (each op alone, bf16, enable_bf16=True). Unlisted
# configs are not enabled on the user's behalf and are left as the user set them.
BF16_ON_XNNPACK: dict[str, bool] = {
    **dict.fromkeys(
        [
            "abs.default",
            "add.Tensor",
            "addmm.default",
            "cat.default",
            "ceil.default",
            "clamp.default",
            "constant_pad_nd.default",
            "cos.default",
            "div.Tensor",
            "exp.default",
            "floor.default",
            "gelu.default",
            "hardswish.default",
            "hardtanh.default",
            "leaky_relu.default",
            "linear.default",
            "log.default",
            "maximum.default",
            "minimum.default",
            "mm.default",
            "mul.Tensor",
            "neg.default",
            "permute_copy.default",
            "pow.Tensor_Scalar",
            "relu.default",
            "rsqrt.default",
            "sigmoid.default",
            "sin.default",
            "slice_copy.Tensor",
            "sqrt.default",
            "sub.Tensor",
            "tanh.default",
            "view_copy.default",
            "_to_dim_order_copy.default",
            "_to_copy.default",
        ],
        True,
    ),
    **dict.fromkeys(
        [
            "convolution.default",
            "bmm.default",
            "_softmax.default",
            "avg_pool2d.default",
            "max_pool2d.default",
            "mean.dim",
            "upsample_bilinear2d.vec",
        ],
        False,
    ),
}


@dataclass(frozen=True)
class EnableBf16:
    """The program computes in bf16 and the user left `enable_bf16` unset."""

    bf16_nodes: int


def _output_dtype(node: torch.fx.Node) -> torch.dtype | None:
    value = node_value(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def bf16_compute_nodes(program: ExportedProgram) -> list[torch.fx.Node]:
    return [
        n
        for n in program.graph.nodes
        if n.op == "call_function" and _output_dtype(n) is torch.bfloat16
    ]


def bf16_gemms(program: ExportedProgram) -> list[torch.fx.Node]:
    return [n for n in bf16_compute_nodes(program) if op_qualified_name(n.target) in _GEMM_OPS]


def match_enable_bf16(program: ExportedProgram, user_setting: bool | None) -> EnableBf16 | Declined:
    """`user_setting` is None when the user did not pass `enable_bf16`."""
    if user_setting is not None:
        return Declined(f"enable_bf16={user_setting} was set by the user")
    nodes = bf16_compute_nodes(program)
    if not nodes:
        return Declined("the program computes nothing in bf16")
    return EnableBf16(len(nodes))


def record_bf16_left_on_portable(program: ExportedProgram) -> None:
    """Called when the user set enable_bf16=False: warn about every bf16 GEMM left behind."""
    gemms = bf16_gemms(program)
    if not gemms:
        return
    names = ", ".join(n.name for n in gemms)
    record_declined(
        FOLD,
        names,
        f"enable_bf16=False: {len(gemms)} bf16 GEMMs stay on portable kernels ({names}); "
        "leave enable_bf16 unset or pass True to delegate them",
        level=logging.WARNING,
    )


def _target(node: torch.fx.Node) -> str:
    return op_qualified_name(node.target).split(".", 1)[-1]


def record_bf16_without_kernel(program: ExportedProgram, enabled: Iterable[str]) -> None:
    """Warn about bf16 ops a config would take but XNNPACK cannot compile in bf16."""
    enabled = set(enabled)
    for node in bf16_compute_nodes(program):
        target = _target(node)
        if BF16_ON_XNNPACK.get(target) is False and target not in enabled:
            record_declined(
                FOLD,
                node.name,
                f"XNNPACK in executorch 1.5.1 cannot compile a bf16 {target.split('.')[0]}; "
                "it runs on portable kernels",
                level=logging.WARNING,
            )


def bf16_applies(program: ExportedProgram, user_setting: bool | None) -> bool:
    """Whether `bf16_settings` changes anything for this program."""
    return user_setting is True or (user_setting is None and bool(bf16_compute_nodes(program)))


def bf16_setting(target: str, user_setting: bool | None) -> bool:
    """What a config with this target runs with, given bf16 is on for the program."""
    known = BF16_ON_XNNPACK.get(target)
    if user_setting is None:
        return known is True
    return bool(user_setting) and known is not False


@contextlib.contextmanager
def bf16_settings(configs: Iterable, user_setting: bool | None) -> Iterator[list[str]]:
    """Each config runs the block with `bf16_setting`; each gets its own setting back after it.

    Yields the targets that accept bf16 inside the block.
    """
    configs = list(configs)
    before = [config.enable_bf16 for config in configs]
    for config in configs:
        config.enable_bf16 = bf16_setting(config.target_name, user_setting)
    try:
        yield [config.target_name for config in configs if config.enable_bf16]
    finally:
        for config, setting in zip(configs, before, strict=True):
            config.enable_bf16 = setting


@contextlib.contextmanager
def bf16_scope(program: ExportedProgram, user_setting: bool | None, configs: Iterable):
    """The context `partition()` runs in: bf16 enabled, upstream's setting, or a warning."""
    match = match_enable_bf16(program, user_setting)
    if user_setting is False or (isinstance(match, Declined) and user_setting is None):
        if user_setting is False:
            record_bf16_left_on_portable(program)
        yield
        return
    with bf16_settings(configs, user_setting) as enabled:
        if isinstance(match, EnableBf16):
            record_applied(
                FOLD,
                "program",
                f"{match.bf16_nodes} ops compute in bf16 and enable_bf16 was not set: "
                "bf16 enabled on the configs whose XNNPACK kernel runs bf16",
            )
        record_bf16_without_kernel(program, enabled)
        yield
