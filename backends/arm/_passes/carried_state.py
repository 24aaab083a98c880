# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Which values persist from one call to the next (carried state).

A fold that moves arithmetic across a value the model carries to its next call
changes how that value is quantized, and the error compounds step after step.
Two signals say a value is carried:

- structural: it is written back to a mutable buffer or a mutated user input
  (BUFFER_MUTATION / USER_INPUT_MUTATION outputs of an ExportedProgram, or an
  in-place `copy_` into a graph input or attribute in an unlifted module);
- explicit: `mark_carried_quant_state(node)`, for functional recurrent state
  (passed in as an argument, returned as an output) that nothing in the graph
  distinguishes from an ordinary output. `mark_carried_state_outputs` marks by
  program output index.

Only the op that rounds a carried value is guarded (see `carried_region`):
CONTRIBUTING.md ("Carried state") records the rollout measurement behind it.

The mark lives in `node.meta["custom"]`, which torch.export, `to_edge` and the
partitioner copy to the nodes they create, so it reaches the backend pipeline.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.fx import GraphModule, Node

from etfold.backends.arm._passes.op_families import COPY_OPS, quantization_source
from etfold.exir.passes.graph_walk import state_writes, underlying_op

CARRIED_QUANT_STATE = "etfold.carried_quant_state"


def mark_carried_quant_state(node: Node) -> None:
    """Declare that `node`'s value is carried to the next call (functional state)."""
    # a fresh dict: node copies may share the old one
    node.meta["custom"] = {**node.meta.get("custom", {}), CARRIED_QUANT_STATE: True}


def is_carried_quant_state(node: Node) -> bool:
    return bool(node.meta.get("custom", {}).get(CARRIED_QUANT_STATE, False))


def mark_carried_state_outputs(
    program: ExportedProgram | GraphModule, output_indices: Iterable[int]
) -> list[Node]:
    """Mark the program outputs at `output_indices` (as the caller sees them) as carried state.

    For an ExportedProgram the indices count user outputs only; buffer and input
    mutations are carried already. Returns the marked nodes.
    """
    graph_module = program.graph_module if isinstance(program, ExportedProgram) else program
    outputs = list(graph_module.graph.output_node().args[0])
    if isinstance(program, ExportedProgram):
        specs = program.graph_signature.output_specs
        outputs = [
            value
            for spec, value in zip(specs, outputs, strict=True)
            if spec.kind == OutputKind.USER_OUTPUT
        ]
    marked = []
    for index in output_indices:
        if not 0 <= index < len(outputs):
            raise IndexError(
                f"output index {index} out of range: the program has {len(outputs)} outputs"
            )
        value = outputs[index]
        if not isinstance(value, Node):
            raise ValueError(f"output {index} is not a graph value: {value!r}")
        mark_carried_quant_state(value)
        marked.append(value)
    return marked


def carried_values(
    graph_module: GraphModule, exported_program: ExportedProgram | None = None
) -> list[Node]:
    """The values written back to a buffer, parameter, input or attribute, in place or
    functionalized alike (`graph_walk.state_writes`): for a copy, its source (the copy
    itself is gone once the program is functionalized); for any other in-place op, its
    result (`state.add_(y)` leaves state + y, which that op rounds)."""
    values = []
    for write in state_writes(graph_module, exported_program):
        value = write.value
        while underlying_op(value.target) in COPY_OPS and isinstance(value.args[1], Node):
            value = value.args[1]
        if value not in values:
            values.append(value)
    return values


def mark_write_backs(program: ExportedProgram) -> list[Node]:
    """Mark every value the program writes back to a buffer or input as carried state.

    Run on the whole program before partitioning: a backend pass later sees only
    its delegate, where a write-back outside it looks like an ordinary output.
    """
    marked = carried_values(program.graph_module, program)
    for value in marked:
        mark_carried_quant_state(value)
    return marked


def carried_region(
    graph_module: GraphModule, exported_program: ExportedProgram | None = None
) -> frozenset[Node]:
    """The nodes whose rounding is the carried values' own rounding.

    From each carried value back through ops that keep their input's
    quantization (layout ops, inference no-ops, relu-like clamps) to the first
    op that computes and requantizes: a fold there changes how the carried value
    itself is rounded each step. A fold further upstream changes only an
    intermediate rounding; the carried value keeps its own observer, op and
    quantization parameters.
    """
    seeds = carried_values(graph_module, exported_program)
    seeds += [n for n in graph_module.graph.nodes if n.op != "output" and is_carried_quant_state(n)]
    region: set[Node] = set()
    for node in seeds:
        while isinstance(node, Node) and node not in region:
            region.add(node)
            node = quantization_source(node)
    return frozenset(region)
