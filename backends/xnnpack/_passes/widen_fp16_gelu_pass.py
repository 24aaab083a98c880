"""Compute fp16 GELU in fp32, so XNNPACK takes it instead of leaving it to portable.

    y = gelu(x)                          x, y: float16
      -> y = to_fp16(gelu(to_fp32(x)))

XNNPACK has no fp16 GELU and upstream declines it, splitting every fp16 MLP in
two. PyTorch's own CPU kernel computes half GELU in fp32 and rounds once, so the
widened form is the same function; its two converts are delegated as XNNPACK
converts. Runs on the ATen program, before decomposition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from etfold.decisions import Declined, record_applied

FOLD = "xnnpack.widen_fp16_gelu"

_GELU = torch.ops.aten.gelu.default
_TO_COPY = torch.ops.aten._to_copy.default


@dataclass(frozen=True)
class Fp16Gelu:
    node: torch.fx.Node
    source: torch.fx.Node


def match_fp16_gelu(node: torch.fx.Node) -> Fp16Gelu | Declined | None:
    """None for nodes that are not GELU at all (nothing worth recording)."""
    if node.op != "call_function" or node.target is not _GELU:
        return None
    source = node.args[0]
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return Declined("GELU input has no tensor metadata")
    if value.dtype is not torch.float16:
        return None  # fp32 and bf16 GELU are upstream's business
    return Fp16Gelu(node, source)


def _convert(graph: torch.fx.Graph, value: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    converted = graph.call_function(_TO_COPY, (value,), {"dtype": dtype})
    converted.meta["val"] = _TO_COPY(value.meta["val"], dtype=dtype)
    return converted


def rewrite_fp16_gelu(match: Fp16Gelu) -> None:
    gelu, graph = match.node, match.node.graph
    with graph.inserting_before(gelu):
        widened = _convert(graph, match.source, torch.float32)
        gelu.replace_input_with(match.source, widened)
    gelu.meta["val"] = _GELU(widened.meta["val"], **gelu.kwargs)
    with graph.inserting_after(gelu):
        narrowed = graph.call_function(_TO_COPY, (gelu,), {"dtype": torch.float16})
    narrowed.meta["val"] = _TO_COPY(gelu.meta["val"], dtype=torch.float16)
    gelu.replace_all_uses_with(narrowed, delete_user_cb=lambda user: user is not narrowed)
    record_applied(FOLD, gelu.name, "fp16 GELU computed in fp32 between two delegated converts")


def widen_fp16_gelu(program: ExportedProgram) -> ExportedProgram:
    """Rewrite every fp16 GELU in place; the same program object comes back."""
    matches = [m for m in map(match_fp16_gelu, program.graph.nodes) if isinstance(m, Fp16Gelu)]
    for match in matches:
        rewrite_fp16_gelu(match)
    if matches:
        program.graph_module.recompile()
    return program
