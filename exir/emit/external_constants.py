# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The external constant map must not hold two different tensors under one name.

ExecuTorch's emitter keys external constants (`.ptd` entries) by fully qualified
name across all methods: when two methods tag different data under one name, the
later one silently replaces the earlier, and one method reads the other's weights.
`give_distinct_data_distinct_names` prevents it in a lowering's own programs;
`check_external_constant_names` detects it in any program.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature

from etfold.exir.passes.graph_walk import STATE_KINDS, stored_value, tensor_digest
from etfold.exir.program.buffer_marks import state_writes


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


def _stored_constants(programs: Mapping[str, ExportedProgram]):
    """(method, name, tensor) of every stored input but written state: a buffer written
    under one name in several methods is state they share, and keeps its name."""
    written = {fqn for program in programs.values() for fqn in state_writes(program)}
    for method, program in programs.items():
        for spec in program.graph_signature.input_specs:
            if spec.kind in STATE_KINDS and spec.target not in written | {None}:
                value = stored_value(program, spec.kind, spec.target, spec.persistent)
                if isinstance(value, torch.Tensor):
                    yield method, spec.target, value


def give_distinct_data_distinct_names(programs: Mapping[str, ExportedProgram]) -> dict:
    """Rename, in place, each constant whose name other methods hold with different data,
    so whichever constants `to_executorch` later tags external get one entry per tensor.

    Only for programs the caller owns (a lowering's results). Methods are taken in
    name order, whatever order the mapping has: those holding the first method's data
    keep the name; each other method's constant becomes `name.method`.
    Returns {(method, old name): new name}.
    """
    by_name = defaultdict(dict)
    for method, name, value in _stored_constants(programs):
        by_name[name][method] = value
    taken = set(by_name)
    renames = {}
    for name, values in by_name.items():
        if len(values) < 2:
            continue
        first = None
        for method, value in sorted(values.items(), key=lambda item: item[0]):
            digest = tensor_digest(value)
            first = first or digest
            if digest != first:
                renames[(method, name)] = _unused(f"{name}.{method}", taken)
    for method, program in programs.items():
        _rename_constants(program, {old: new for (m, old), new in renames.items() if m == method})
    return renames


def _unused(name: str, taken: set[str]) -> str:
    candidate, n = name, 1
    while candidate in taken:
        candidate, n = f"{name}{n}", n + 1
    taken.add(candidate)
    return candidate


def _rename_constants(program: ExportedProgram, new_names: Mapping[str, str]) -> None:
    """New signature and state dicts (never mutated: another program may share them)."""
    if not new_names:
        return
    signature = program.graph_signature
    program._graph_signature = ExportGraphSignature(
        input_specs=[
            replace(spec, target=new_names[spec.target]) if spec.target in new_names else spec
            for spec in signature.input_specs
        ],
        output_specs=list(signature.output_specs),
    )
    program._state_dict = {new_names.get(k, k): v for k, v in program.state_dict.items()}
    program._constants = {new_names.get(k, k): v for k, v in program.constants.items()}
