# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Whether a program's bf16 work is offered to XNNPACK, and saying so when it is not.

    enable_bf16 unset,  program computes in bf16  -> bf16 configs enabled for this program
    enable_bf16 unset,  no bf16 in the program    -> upstream's default (off): nothing changes
    enable_bf16=False,  bf16 GEMMs in the program -> decline at WARNING naming the GEMMs
    enable_bf16=True                              -> upstream's behaviour

Upstream keeps bf16 off unless asked, so a bf16 decoder silently runs its GEMMs on
portable kernels. Enabling is scoped to one `partition()` call: the configs
carry the user's setting again afterwards, so one partitioner can lower fp32 and
bf16 programs alike.
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


@dataclass(frozen=True)
class EnableBf16:
    """The program computes in bf16 and the user left `enable_bf16` unset."""

    bf16_nodes: int


def _output_dtype(node: torch.fx.Node) -> torch.dtype | None:
    value = node.meta.get("val")
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


@contextlib.contextmanager
def bf16_enabled(configs: Iterable) -> Iterator[None]:
    """Every config accepts bf16 inside the block; each gets its own setting back after it."""
    configs = list(configs)
    before = [config.enable_bf16 for config in configs]
    for config in configs:
        config.enable_bf16 = True
    try:
        yield
    finally:
        for config, setting in zip(configs, before, strict=True):
            config.enable_bf16 = setting


def bf16_scope(program: ExportedProgram, user_setting: bool | None, configs: Iterable):
    """The context `partition()` runs in: bf16 enabled, upstream's setting, or a warning."""
    match = match_enable_bf16(program, user_setting)
    if isinstance(match, EnableBf16):
        record_applied(
            FOLD,
            "program",
            f"{match.bf16_nodes} ops compute in bf16 and enable_bf16 was not set: "
            "bf16 configs enabled for this program",
        )
        return bf16_enabled(configs)
    if user_setting is False:
        record_bf16_left_on_portable(program)
    return contextlib.nullcontext()
