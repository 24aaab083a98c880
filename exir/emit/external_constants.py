# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The external constant map must not hold two different tensors under one name.

ExecuTorch's emitter keys external constants (`.ptd` entries) by fully qualified
name across all methods: when two methods tag different data under one name, the
later one silently replaces the earlier, and one method reads the other's weights.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from etfold.exir.passes.graph_walk import stored_value, tensor_digest


class ExternalConstantCollisionError(ValueError):
    """Two methods would write different tensors under one external constant name."""


@dataclass(frozen=True)
class ExternalEntry:
    method: str
    tag: str
    digest: str  # of dtype, shape and bytes


def _tagged_placeholders(programs: Mapping[str, ExportedProgram]):
    for method, program in programs.items():
        specs = {
            s.arg.name: s for s in program.graph_signature.input_specs if hasattr(s.arg, "name")
        }
        for node in program.graph.find_nodes(op="placeholder"):
            tag = node.meta.get("constant_tag")
            spec = specs.get(node.name)
            if tag is not None and spec is not None and spec.target is not None:
                yield method, program, node, spec, str(tag)


def _digest(program: ExportedProgram, node: torch.fx.Node, spec) -> str:
    value = stored_value(program, spec.kind, spec.target, spec.persistent)
    if isinstance(value, torch.Tensor):
        return tensor_digest(value)
    storage = getattr(node.meta.get("spec"), "storage", None)
    if storage is None:
        return "unknown"
    return tensor_digest(torch.frombuffer(bytearray(storage), dtype=torch.uint8))


def external_constant_entries(
    programs: Mapping[str, ExportedProgram],
) -> dict[str, list[ExternalEntry]]:
    """Placeholders tagged for an external file (`meta["constant_tag"]`) under a name
    that more than one method writes, by name. Only those are hashed."""
    tagged = defaultdict(list)
    for method, program, node, spec, tag in _tagged_placeholders(programs):
        tagged[spec.target].append((method, program, node, spec, tag))
    return {
        name: [
            ExternalEntry(method, tag, _digest(program, node, spec))
            for method, program, node, spec, tag in found
        ]
        for name, found in tagged.items()
        if len({method for method, *_ in found}) > 1
    }


def check_external_constant_names(programs: Mapping[str, ExportedProgram]) -> None:
    """Raise when one external constant name would carry different data in different methods."""
    problems = []
    for name, entries in sorted(external_constant_entries(programs).items()):
        if len({e.digest for e in entries}) > 1:
            where = ", ".join(f"{e.method} (file {e.tag!r})" for e in entries)
            problems.append(
                f"external constant {name!r} is written by methods {where}, and the data differ"
            )
    if problems:
        raise ExternalConstantCollisionError(
            "; ".join(problems)
            + ". The external constant map holds one tensor per name, so one method would read the other's"
            " data. Give the folded constants distinct names (etfold's constant_prop_pass with"
            " register_like_source=True names them by their expression)."
        )
