# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Where each etfold Arm pass goes: the insertion table and how its entries reach the pipelines.

`ARM_PASS_INSERTIONS` is the one place to add an etfold Arm pass. Each entry
says which pass to build, next to which upstream pass (by class name in
`executorch.backends.arm._passes`) it goes, before or after it, and in which
pipeline:

- "backend": `ArmPassManager._tosa_pipeline` (edge → TOSA). Entries reach it
  through upstream's insertion registry (`add_pass_insertions`). The registry
  holds instances, so the factory is called once, at registration; a pass that
  needs the ExportedProgram declares an `exported_program` attribute, which
  upstream's adapter fills in for each run.
- "annotation": `ArmPassManager.transform_for_annotation_pipeline` (before
  calibration). The registry does not reach it (that pipeline never applies
  insertions), so entries enter through `inserting_add_pass`, a wrapper of
  `ArmPassManager.add_pass`. The factory is called each time the pipeline is
  built.

Entries with the same anchor and position run in tuple order. The same wrapper
drops `RETIRED_UPSTREAM_PASSES` from both pipelines.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from etfold.backends.arm.upstream_arm import (
    ArmRegistrationError,
    pass_manager_module,
    upstream_pass_class,
)

Position = Literal["before", "after"]
Pipeline = Literal["backend", "annotation"]


@dataclass(frozen=True)
class LazyPass:
    """Builds `module:Class(**kwargs)` when called; importing stays cheap until then."""

    path: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    def __call__(self):
        module_name, _, class_name = self.path.partition(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        return cls(**dict(self.kwargs))


def lazy_pass(path: str, **kwargs: Any) -> LazyPass:
    return LazyPass(path, tuple(sorted(kwargs.items())))


@dataclass(frozen=True)
class ArmPassInsertion:
    """One etfold pass placed next to an upstream Arm pass."""

    fold: str  # stable id, as recorded in etfold.decisions
    factory: Callable[[], Any]  # returns the pass instance
    anchor: str  # upstream pass class name in executorch.backends.arm._passes
    position: Position
    pipeline: Pipeline


_SCALAR_MUL = "etfold.backends.arm._passes.fold_scalar_mul_into_conv_pass:FoldScalarMulIntoConvPass"

_ARM = "etfold.backends.arm._passes."

# The one place to add an etfold Arm pass.
ARM_PASS_INSERTIONS: tuple[ArmPassInsertion, ...] = (
    # upstream runs its scalar-mul fold in both pipelines; ours takes exactly its slots
    ArmPassInsertion(
        "arm.scalar_mul_into_conv",
        lazy_pass(_SCALAR_MUL, tfa_pass=True),
        anchor="FoldScalarMulIntoConvPass",
        position="before",
        pipeline="annotation",
    ),
    ArmPassInsertion(
        "arm.scalar_mul_into_conv",
        lazy_pass(_SCALAR_MUL),
        anchor="RewriteConvPass",
        position="before",
        pipeline="backend",
    ),
    # DyT: gamma/beta into the next conv in fp32 before calibration; then, on the
    # integer graph, alpha into the tanh TABLE and any remaining exact affine into the conv
    ArmPassInsertion(
        "arm.dyt_affine_into_conv_float",
        lazy_pass(_ARM + "fold_dyt_affine_into_conv_float_pass:FoldDyTAffineIntoConvFloatPass"),
        anchor="FoldScalarMulIntoConvPass",
        position="after",
        pipeline="annotation",
    ),
    ArmPassInsertion(
        "arm.dyt_alpha_into_lut",
        lazy_pass(_ARM + "fold_dyt_alpha_into_lut_pass:FoldDyTAlphaIntoLUTPass"),
        anchor="InsertTableOpsPass",
        position="before",
        pipeline="backend",
    ),
    # a wrong program in stock FP lowering: mul/add whose lower-rank operand comes first
    ArmPassInsertion(
        "arm.higher_rank_operand_first",
        lazy_pass(_ARM + "higher_rank_operand_first_pass:HigherRankOperandFirstPass"),
        anchor="MatchArgRanksPass",
        position="before",
        pipeline="backend",
    ),
    ArmPassInsertion(
        "arm.dyt_affine_into_conv",
        lazy_pass(_ARM + "fold_dyt_affine_into_conv_pass:FoldDyTAffineIntoConvPass"),
        anchor="InsertTableOpsPass",
        position="after",
        pipeline="backend",
    ),
)

# Upstream passes that must not run while etfold's folds are registered.
RETIRED_UPSTREAM_PASSES: tuple[str, ...] = ("FoldScalarMulIntoConvPass",)


def add_pass_insertions(entries: list[tuple[type, Position, Any]]) -> list[type]:
    """Put each pass instance before/after its anchor type in upstream's insertion registry.
    Returns the anchors that had no registry entry before, for `remove_pass_insertions`."""
    module = pass_manager_module()
    registry = module._registered_pass_insertions
    created = list(dict.fromkeys(a for a, _, _ in entries if a not in registry))
    for anchor_type, position, instance in entries:
        register = getattr(module, f"register_pass_insertions_{position}")
        register(anchor_type, [instance])
    return created


def remove_pass_insertions(entries: list[tuple[type, Position, Any]], created: list[type]) -> None:
    """Take exactly these instances out of upstream's registry again (others' entries stay),
    and drop the anchors `add_pass_insertions` created once they are empty."""
    registry = pass_manager_module()._registered_pass_insertions
    for anchor_type, position, instance in entries:
        insertions = registry.get(anchor_type)
        if insertions is None:
            continue
        passes = insertions.before_passes if position == "before" else insertions.after_passes
        passes[:] = [p for p in passes if p is not instance]
    for anchor_type in created:
        insertions = registry.get(anchor_type)
        if insertions is not None and not insertions.before_passes and not insertions.after_passes:
            del registry[anchor_type]


def _annotation_entries(
    insertions: tuple[ArmPassInsertion, ...], position: Position
) -> dict[type, list[ArmPassInsertion]]:
    by_anchor: dict[type, list[ArmPassInsertion]] = {}
    for entry in insertions:
        if entry.pipeline == "annotation" and entry.position == position:
            by_anchor.setdefault(upstream_pass_class(entry.anchor), []).append(entry)
    return by_anchor


_ANCHORS_SEEN = "_etfold_annotation_anchors_seen"


def inserting_add_pass(
    retired: tuple[type, ...], insertions: tuple[ArmPassInsertion, ...]
) -> Callable[[Callable], Callable]:
    """`ArmPassManager.add_pass` that drops `retired` passes and places the "annotation"
    entries of `insertions` next to their anchors."""
    before = _annotation_entries(insertions, "before")
    after = _annotation_entries(insertions, "after")

    def make(original_add_pass: Callable) -> Callable:
        def add_pass(self, pipeline_pass):
            # upstream builds the annotation pipeline from passes made with tfa_pass=True
            in_annotation = bool(getattr(pipeline_pass, "is_tfa_pass", False))
            anchor_type = type(pipeline_pass)
            if in_annotation:
                self.__dict__.setdefault(_ANCHORS_SEEN, set()).add(anchor_type.__name__)
                for entry in before.get(anchor_type, ()):
                    original_add_pass(self, entry.factory())
            if anchor_type not in retired:
                original_add_pass(self, pipeline_pass)
            if in_annotation:
                for entry in after.get(anchor_type, ()):
                    original_add_pass(self, entry.factory())

        add_pass.__etfold_wrapped__ = original_add_pass  # type: ignore[attr-defined]
        return add_pass

    return make


def built_annotation_pipeline(profile: str):
    """An ArmPassManager after building its annotation pipeline on an empty graph (cheap)."""
    import torch
    from executorch.backends.arm.tosa.compile_spec import TosaCompileSpec

    manager = pass_manager_module().ArmPassManager(TosaCompileSpec(profile))
    empty = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    empty.graph.output(())
    empty.recompile()
    manager.transform_for_annotation_pipeline(empty)
    return manager


def check_annotation_anchors(insertions: tuple[ArmPassInsertion, ...]) -> None:
    """Raise unless the annotation pipeline, built with `inserting_add_pass` installed,
    still adds every anchor an "annotation" entry names."""
    wanted = {e.anchor for e in insertions if e.pipeline == "annotation"}
    if not wanted:
        return
    seen = built_annotation_pipeline("TOSA-1.0+INT").__dict__.get(_ANCHORS_SEEN, set())
    missing = sorted(wanted - seen)
    if missing:
        raise ArmRegistrationError(
            f"ArmPassManager.transform_for_annotation_pipeline no longer adds {missing} "
            "(with tfa_pass=True); etfold's annotation-pipeline passes anchor on them"
        )
