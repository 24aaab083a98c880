# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Rewrite: apply a `ConstantFolds` match to the program. Never declines.

Placement. A new placeholder goes after the last placeholder of its kind (else
after the kinds export puts before it), and the input specs follow placeholder
order, so callers binding by position read the right tensor; values are
registered in graph order. Sources nothing reads any more are unregistered and
erased. A constant returned as a user output goes through a clone: `aten.clone`
in ATen dialect; in Edge dialect `aten.clone`, or `_clone_dim_order` when
`skip_dim_order` is False (upstream's `_skip_dim_order`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from executorch.exir.dialects._ops import ops as exir_ops
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, OutputKind, TensorArgument

from etfold.decisions import record_applied
from etfold.exir.passes.constant_prop import FOLD
from etfold.exir.passes.constant_prop.name import (
    UPSTREAM_PREFIX,
    ConstantFolds,
    Materialization,
)
from etfold.exir.passes.constant_prop.verdicts import SourcePolicy, constant_sources
from etfold.exir.passes.graph_walk import PLACEHOLDER_RANK, input_kinds
from etfold.exir.passes.node_shapes import node_value
from etfold.exir.program.buffer_marks import BUFFER_FOLD_BLOCKERS

_PLACEHOLDER_PREFIX = {InputKind.PARAMETER: "p_", InputKind.BUFFER: "b_"}


@dataclass
class _Inputs:
    """The program's input specs by placeholder name, kept current while placeholders change."""

    specs: dict[str, InputSpec]
    kinds: dict[str, InputKind]
    by_target: dict[str, torch.fx.Node] = field(default_factory=dict)

    @classmethod
    def of(cls, ep: ExportedProgram) -> _Inputs:
        specs = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
        inputs = cls(specs, input_kinds(ep))
        for node in ep.graph.find_nodes(op="placeholder"):
            spec = specs.get(node.name)
            if spec is not None and spec.target:
                inputs.by_target[spec.target] = node
        return inputs

    def add(self, placeholder: torch.fx.Node, spec: InputSpec) -> None:
        self.specs[placeholder.name] = spec
        self.kinds[placeholder.name] = spec.kind
        self.by_target[spec.target] = placeholder


def _fake_mode(ep: ExportedProgram):
    mode = detect_fake_mode(tuple(node_value(n) for n in ep.graph.nodes if "val" in n.meta))
    return mode if mode is not None else FakeTensorMode()


def _upstream_name(ep: ExportedProgram) -> str:
    name = f"{UPSTREAM_PREFIX}{len(ep.constants)}"
    if name in ep.constants:
        taken = [
            int(k[len(UPSTREAM_PREFIX) :])
            for k in ep.constants
            if k.startswith(UPSTREAM_PREFIX) and k[len(UPSTREAM_PREFIX) :].isdigit()
        ]
        name = f"{UPSTREAM_PREFIX}{max(taken, default=-1) + 1}"
    return name


def _register(ep: ExportedProgram, fold: Materialization, target: str) -> None:
    if fold.kind == InputKind.PARAMETER:
        ep.state_dict[target] = torch.nn.Parameter(fold.tensor, requires_grad=False)
    elif fold.kind == InputKind.BUFFER and fold.persistent:
        ep.state_dict[target] = fold.tensor
    else:
        ep.constants[target] = fold.tensor


def _insertion_point(ep: ExportedProgram, kinds: Mapping[str, InputKind], kind: InputKind):
    """After the last placeholder of `kind`, else after the last of an earlier kind."""
    rank = PLACEHOLDER_RANK[kind]
    same = earlier = None
    for node in ep.graph.find_nodes(op="placeholder"):
        node_kind = kinds.get(node.name, InputKind.USER_INPUT)
        if node_kind == kind:
            same = node
        elif PLACEHOLDER_RANK[node_kind] < rank:
            earlier = node
    anchor = same or earlier
    if anchor is not None:
        return ep.graph.inserting_after(anchor)
    return ep.graph.inserting_before(next(iter(ep.graph.nodes)))


def _new_placeholder(
    ep: ExportedProgram, fold: Materialization, target: str, inputs: _Inputs, fake_mode
) -> torch.fx.Node:
    """Register the folded tensor under `target`; add its placeholder and input spec."""
    _register(ep, fold, target)
    name = target
    if fold.target is not None:
        name = _PLACEHOLDER_PREFIX.get(fold.kind, "c_") + target.replace(".", "_")
    with _insertion_point(ep, inputs.kinds, fold.kind):
        placeholder = ep.graph.create_node("placeholder", name, name=name)
    placeholder.target = placeholder.name  # the graph namespace may have renamed it
    if fold.target is None:
        placeholder.meta.update(fold.node.meta)
    elif fold.custom is not None:
        placeholder.meta["custom"] = dict(fold.custom)
    if fold.buffer_fold_blockers is not None:
        placeholder.meta[BUFFER_FOLD_BLOCKERS] = fold.buffer_fold_blockers
    placeholder.meta["val"] = fake_mode.from_tensor(fold.tensor, static_shapes=True)
    spec = InputSpec(fold.kind, TensorArgument(name=placeholder.name), target, fold.persistent)
    inputs.add(placeholder, spec)
    return placeholder


def _erase_folded(ep: ExportedProgram, folds: ConstantFolds, inputs: _Inputs) -> None:
    """Erase the folded nodes, then the sources nothing reads any more."""
    gone = {fold.node for fold in folds.materialize} | set(folds.erase)
    for node in reversed([n for n in ep.graph.nodes if n in gone]):
        assert not node.users, f"{node.name} still has users after folding"
        ep.graph.erase_node(node)
    for source in folds.sources:
        if not source.users:
            spec = inputs.specs.pop(source.name)
            ep.state_dict.pop(spec.target, None)
            ep.constants.pop(spec.target, None)
            ep.graph.erase_node(source)


def _clone_target(ep: ExportedProgram, skip_dim_order: bool):
    """A clone in the graph's own dialect."""
    if ep.dialect != "EDGE":
        return torch.ops.aten.clone.default
    if skip_dim_order:
        return exir_ops.edge.aten.clone.default
    return exir_ops.edge.dim_order_ops._clone_dim_order.default


def _clone_constant_outputs(ep: ExportedProgram, fold_buffers: bool, skip_dim_order: bool):
    """Outputs are rebound to surviving nodes; a constant returned as an output goes through a clone."""
    constants, _ = constant_sources(ep, SourcePolicy(fold_buffers=fold_buffers))
    output = ep.graph.output_node()
    returned = list(output.args[0])
    specs = ep.graph_signature.output_specs
    for position, (value, spec) in enumerate(zip(returned, specs, strict=True)):
        if not isinstance(value, torch.fx.Node):
            continue
        if spec.kind == OutputKind.USER_OUTPUT and value in constants:
            with ep.graph.inserting_before(output):
                copy = ep.graph.call_function(_clone_target(ep, skip_dim_order), (value,))
            copy.meta["val"] = node_value(value)
            returned[position] = value = copy
        if isinstance(spec.arg, TensorArgument) and spec.arg.name != value.name:
            spec.arg = TensorArgument(name=value.name)
    output.args = (type(output.args[0])(returned),)


def rewrite_constant_folds(
    ep: ExportedProgram, folds: ConstantFolds, *, skip_dim_order: bool = True
) -> ExportedProgram:
    inputs = _Inputs.of(ep)
    fake_mode = _fake_mode(ep)
    for fold in folds.materialize:
        target = fold.target if fold.target is not None else _upstream_name(ep)
        placeholder = inputs.by_target.get(target)
        if placeholder is None:
            placeholder = _new_placeholder(ep, fold, target, inputs, fake_mode)
        fold.node.replace_all_uses_with(placeholder)
        where = f"{fold.kind.name.lower()} {target}"
        record_applied(FOLD, fold.node.name, f"{fold.ops_folded} op(s) -> {where}")
    _erase_folded(ep, folds, inputs)
    order = [n.name for n in ep.graph.find_nodes(op="placeholder")]
    ep.graph_signature.input_specs = [inputs.specs[name] for name in order]
    _clone_constant_outputs(ep, folds.fold_buffers, skip_dim_order)
    ep.graph_module.recompile()
    return ep
