# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""How etfold's Arm passes enter ArmPassManager pipelines.

Nothing is registered on import: `register_arm_folds()` installs, and
`unregister_arm_folds()` restores upstream exactly.

Extension point: `ARM_PASS_INSERTIONS`. Each entry says which pass to build,
next to which upstream pass (by class name in `executorch.backends.arm._passes`)
it goes, before or after it, and in which pipeline:

- "backend": `ArmPassManager._tosa_pipeline` (edge → TOSA). Entries reach it
  through upstream's insertion registry (`register_pass_insertions_before/after`).
  The registry holds instances, so the factory is called once, at registration;
  a pass that needs the ExportedProgram declares an `exported_program`
  attribute, which upstream's adapter fills in for each run.
- "annotation": `ArmPassManager.transform_for_annotation_pipeline` (before
  calibration). The registry does not reach it (that pipeline never applies
  insertions), so entries enter through the one substitution below. The factory
  is called each time the pipeline is built.

Entries with the same anchor and position run in tuple order.

Retired upstream passes (`RETIRED_UPSTREAM_PASSES`) are dropped from both
pipelines while registered.

The substitution: while registered, `ArmPassManager.add_pass` is wrapped. The
wrapper drops retired passes and, for passes added with `tfa_pass=True`,
inserts the "annotation" entries next to their anchor. The same install also
wraps upstream's (empty) `transform_for_pre_decomposition_pipeline`, the one
point that sees the whole program before partitioning, to mark values written
back to buffers or inputs as carried state (on a copy, which upstream lowers
from then on: the program it hands in is the user's): a backend pass sees only
its delegate, where such a write-back looks like an ordinary output. And it wraps
`EthosUBackend.preprocess` so backend passes can ask which NPU the lowering is
for (`_passes/lowering_target.py`): some folds pay on one NPU only. That is the
one place the Ethos-U compile spec is still known; the backend pipeline below
it gets a TOSA-only spec (`TOSABackend.filter_tosa_compile_specs`), so a
direct `ArmPassManager(EthosUCompileSpec(...))` run is covered by wrapping
`transform_to_backend_pipeline` too, and `EthosUQuantizer`'s annotation run
(before calibration) by wrapping `transform_for_annotation_pipeline`. Registration checks
upstream's shape first (classes, registry functions, the annotation anchors
really being added) and raises `ArmRegistrationError` if anything moved.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

UPSTREAM_PASSES_MODULE = "executorch.backends.arm._passes"
UPSTREAM_PASS_MANAGER_MODULE = "executorch.backends.arm._passes.arm_pass_manager"
UPSTREAM_ETHOS_U_BACKEND_MODULE = "executorch.backends.arm.ethosu.backend"

Position = Literal["before", "after"]
Pipeline = Literal["backend", "annotation"]


class ArmRegistrationError(RuntimeError):
    """Upstream ExecuTorch no longer has the shape etfold's registration relies on."""


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


@dataclass
class _Installed:
    original_add_pass: Callable
    original_pre_decomposition: Callable
    original_backend_pipeline: Callable
    original_annotation_pipeline: Callable
    original_ethos_u_preprocess: Any  # the staticmethod object in EthosUBackend.__dict__
    original_pt2e_fusions: dict[str, Callable]  # torchao's, see pt2e_fusion_guard
    registry_entries: list[tuple[type, Position, Any]]  # (anchor type, position, instance)
    created_registry_keys: list[type]
    insertions: tuple[ArmPassInsertion, ...]


_installed: _Installed | None = None
_lock = threading.RLock()  # registering and unregistering from several threads


def _upstream_pass_class(name: str) -> type:
    module = importlib.import_module(UPSTREAM_PASSES_MODULE)
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ArmRegistrationError(
            f"{UPSTREAM_PASSES_MODULE}.{name} is gone: etfold's Arm registration anchors on it "
            "(see etfold.backends.arm.registration.ARM_PASS_INSERTIONS)"
        )
    return cls


def _pass_manager_module():
    module = importlib.import_module(UPSTREAM_PASS_MANAGER_MODULE)
    needed = (
        "ArmPassManager",
        "register_pass_insertions_before",
        "register_pass_insertions_after",
        "_registered_pass_insertions",
    )
    missing = [name for name in needed if not hasattr(module, name)]
    manager = getattr(module, "ArmPassManager", None)
    for method in (
        "add_pass",
        "transform_for_annotation_pipeline",
        "_configure_pass_insertions",
        "transform_for_pre_decomposition_pipeline",
        "transform_to_backend_pipeline",
    ):
        if manager is not None and not callable(manager.__dict__.get(method)):
            missing.append(f"ArmPassManager.{method}")
    if missing:
        raise ArmRegistrationError(
            f"{UPSTREAM_PASS_MANAGER_MODULE} changed shape; missing: {missing}"
        )
    return module


def _annotation_entries(
    insertions: tuple[ArmPassInsertion, ...], position: Position
) -> dict[type, list[ArmPassInsertion]]:
    by_anchor: dict[type, list[ArmPassInsertion]] = {}
    for entry in insertions:
        if entry.pipeline == "annotation" and entry.position == position:
            by_anchor.setdefault(_upstream_pass_class(entry.anchor), []).append(entry)
    return by_anchor


def _make_add_pass(
    original_add_pass: Callable, retired: tuple[type, ...], insertions: tuple[ArmPassInsertion, ...]
) -> Callable:
    before = _annotation_entries(insertions, "before")
    after = _annotation_entries(insertions, "after")

    def add_pass(self, pipeline_pass):
        # upstream builds the annotation pipeline from passes made with tfa_pass=True
        in_annotation = bool(getattr(pipeline_pass, "is_tfa_pass", False))
        anchor_type = type(pipeline_pass)
        if in_annotation:
            self.__dict__.setdefault("_etfold_annotation_anchors_seen", set()).add(
                anchor_type.__name__
            )
            for entry in before.get(anchor_type, ()):
                original_add_pass(self, entry.factory())
        if anchor_type not in retired:
            original_add_pass(self, pipeline_pass)
        if in_annotation:
            for entry in after.get(anchor_type, ()):
                original_add_pass(self, entry.factory())

    add_pass.__etfold_wrapped__ = original_add_pass  # type: ignore[attr-defined]
    return add_pass


def _marked_copy(exported_program):
    """A copy of the program upstream handed in (the user's own) with its write-backs
    marked as carried state. Every node gets its own `custom` dict: decomposition
    writes annotations into the dict of the node it is tracing (torch's
    `fx_traceback.annotate`), and a copied node shares its original's."""
    from etfold.backends.arm._passes.carried_state import mark_write_backs
    from etfold.backends.arm._passes.fold_batch_norm_into_linear_pass import (
        fold_batch_norms_into_linears,
    )
    from etfold.exir.passes.own_constants_before_batch_norm_fusion_pass import (
        own_constants_before_batch_norm_fusion,
    )
    from etfold.exir.program.working_copy import copy_for_rewrite

    working = copy_for_rewrite(exported_program)
    working = fold_batch_norms_into_linears(own_constants_before_batch_norm_fusion(working))
    for node in working.graph.nodes:
        if "custom" in node.meta:
            node.meta["custom"] = dict(node.meta["custom"])
    mark_write_backs(working)
    return working


def _make_pre_decomposition(original: Callable) -> Callable:
    def transform_for_pre_decomposition_pipeline(self, exported_program):
        return original(self, _marked_copy(exported_program))

    transform_for_pre_decomposition_pipeline.__etfold_wrapped__ = original  # type: ignore[attr-defined]
    return transform_for_pre_decomposition_pipeline


def _make_target_aware(original: Callable) -> Callable:
    """An ArmPassManager pipeline method run inside `lowering_for` its Ethos-U compile spec."""
    from etfold.backends.arm._passes.lowering_target import is_ethos_u_spec, lowering_for

    def pipeline(self, *args, **kwargs):
        if not is_ethos_u_spec(self.compile_spec):
            return original(self, *args, **kwargs)
        with lowering_for(self.compile_spec):
            return original(self, *args, **kwargs)

    pipeline.__name__ = pipeline.__qualname__ = original.__name__
    pipeline.__etfold_wrapped__ = original  # type: ignore[attr-defined]
    return pipeline


def _ethos_u_backend() -> type:
    backend = getattr(
        importlib.import_module(UPSTREAM_ETHOS_U_BACKEND_MODULE), "EthosUBackend", None
    )
    if not isinstance(backend, type) or not isinstance(
        backend.__dict__.get("preprocess"), staticmethod
    ):
        raise ArmRegistrationError(
            f"{UPSTREAM_ETHOS_U_BACKEND_MODULE}.EthosUBackend.preprocess is no longer a "
            "staticmethod; etfold tells backend passes the Ethos-U target through it"
        )
    return backend


def _make_ethos_u_preprocess(original: staticmethod) -> staticmethod:
    """EthosUBackend.preprocess, run inside `lowering_for(its EthosUCompileSpec)`."""
    from etfold.backends.arm._passes.lowering_target import lowering_for

    def preprocess(edge_program, compile_specs):
        from executorch.backends.arm.ethosu import EthosUCompileSpec

        with lowering_for(EthosUCompileSpec._from_list(compile_specs)):
            return original.__func__(edge_program, compile_specs)

    preprocess.__etfold_wrapped__ = original  # type: ignore[attr-defined]
    return staticmethod(preprocess)


def _built_annotation_pipeline(profile: str):
    """An ArmPassManager after building its annotation pipeline on an empty graph (cheap)."""
    import torch
    from executorch.backends.arm.tosa.compile_spec import TosaCompileSpec

    manager = _pass_manager_module().ArmPassManager(TosaCompileSpec(profile))
    empty = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    empty.graph.output(())
    empty.recompile()
    manager.transform_for_annotation_pipeline(empty)
    return manager


def annotation_pipeline_passes(profile: str = "TOSA-1.0+INT") -> list[type]:
    """The pass classes of the annotation pipeline as it is built now, in order."""
    return [type(p) for p in _built_annotation_pipeline(profile).passes]


def _check_annotation_anchors(insertions: tuple[ArmPassInsertion, ...]) -> None:
    wanted = {e.anchor for e in insertions if e.pipeline == "annotation"}
    if not wanted:
        return
    seen = _built_annotation_pipeline("TOSA-1.0+INT").__dict__.get(
        "_etfold_annotation_anchors_seen", set()
    )
    missing = sorted(wanted - seen)
    if missing:
        raise ArmRegistrationError(
            f"ArmPassManager.transform_for_annotation_pipeline no longer adds {missing} (with tfa_pass=True); "
            "etfold's annotation-pipeline passes anchor on them"
        )


def _install(insertions: tuple[ArmPassInsertion, ...]) -> None:
    global _installed
    if _installed is not None:
        if _installed.insertions != insertions:
            raise ArmRegistrationError(
                "a different set of etfold Arm passes is registered; unregister it first"
            )
        return
    module = _pass_manager_module()
    manager_cls = module.ArmPassManager
    original_add_pass = manager_cls.__dict__["add_pass"]
    if hasattr(original_add_pass, "__etfold_wrapped__"):
        raise ArmRegistrationError(
            "ArmPassManager.add_pass is already wrapped by another etfold install"
        )
    retired = tuple(_upstream_pass_class(name) for name in RETIRED_UPSTREAM_PASSES)
    anchors = {e.anchor: _upstream_pass_class(e.anchor) for e in insertions}

    original_pre_decomposition = manager_cls.__dict__["transform_for_pre_decomposition_pipeline"]
    original_backend_pipeline = manager_cls.__dict__["transform_to_backend_pipeline"]
    original_annotation_pipeline = manager_cls.__dict__["transform_for_annotation_pipeline"]
    ethos_u_backend = _ethos_u_backend()
    original_ethos_u_preprocess = ethos_u_backend.__dict__["preprocess"]
    manager_cls.add_pass = _make_add_pass(original_add_pass, retired, insertions)
    manager_cls.transform_for_pre_decomposition_pipeline = _make_pre_decomposition(
        original_pre_decomposition
    )
    manager_cls.transform_to_backend_pipeline = _make_target_aware(original_backend_pipeline)
    manager_cls.transform_for_annotation_pipeline = _make_target_aware(original_annotation_pipeline)
    ethos_u_backend.preprocess = _make_ethos_u_preprocess(original_ethos_u_preprocess)
    from etfold.backends.arm.pt2e_fusion_guard import guard_pt2e_fusions, restore_pt2e_fusions

    original_pt2e_fusions = guard_pt2e_fusions()
    try:
        _check_annotation_anchors(insertions)
        backend = [e for e in insertions if e.pipeline == "backend"]
        instances = [e.factory() for e in backend]
    except BaseException:
        manager_cls.add_pass = original_add_pass
        manager_cls.transform_for_pre_decomposition_pipeline = original_pre_decomposition
        manager_cls.transform_to_backend_pipeline = original_backend_pipeline
        manager_cls.transform_for_annotation_pipeline = original_annotation_pipeline
        ethos_u_backend.preprocess = original_ethos_u_preprocess
        restore_pt2e_fusions(original_pt2e_fusions)
        raise

    entries = [
        (anchors[entry.anchor], entry.position, instance)
        for entry, instance in zip(backend, instances, strict=True)
    ]
    created = add_pass_insertions(entries)
    _installed = _Installed(
        original_add_pass,
        original_pre_decomposition,
        original_backend_pipeline,
        original_annotation_pipeline,
        original_ethos_u_preprocess,
        original_pt2e_fusions,
        entries,
        created,
        insertions,
    )


class ArmFoldsRegistration:
    """What `register_arm_folds()` returns: used in a `with`, it leaves registration
    as it found it when the block ends (the plain call stays registered)."""

    def __init__(self, was_registered: bool):
        self._was_registered = was_registered

    def __enter__(self) -> ArmFoldsRegistration:
        return self

    def __exit__(self, *exc) -> None:
        if not self._was_registered:
            unregister_arm_folds()


def register_arm_folds() -> ArmFoldsRegistration:
    """Install etfold's Arm passes into both pipelines; calling it again changes nothing.

    `with register_arm_folds(): ...` scopes the registration to the block.
    """
    with _lock:
        was_registered = _installed is not None
        _install(ARM_PASS_INSERTIONS)
    return ArmFoldsRegistration(was_registered)


def unregister_arm_folds() -> None:
    """Restore upstream exactly: the original add_pass, and the registry without etfold's passes."""
    with _lock:
        _uninstall()


def _uninstall() -> None:
    global _installed
    if _installed is None:
        return
    module = importlib.import_module(UPSTREAM_PASS_MANAGER_MODULE)
    module.ArmPassManager.add_pass = _installed.original_add_pass
    module.ArmPassManager.transform_for_pre_decomposition_pipeline = (
        _installed.original_pre_decomposition
    )
    module.ArmPassManager.transform_to_backend_pipeline = _installed.original_backend_pipeline
    module.ArmPassManager.transform_for_annotation_pipeline = (
        _installed.original_annotation_pipeline
    )
    _ethos_u_backend().preprocess = _installed.original_ethos_u_preprocess
    from etfold.backends.arm.pt2e_fusion_guard import restore_pt2e_fusions

    restore_pt2e_fusions(_installed.original_pt2e_fusions)
    remove_pass_insertions(_installed.registry_entries, _installed.created_registry_keys)
    _installed = None


def add_pass_insertions(entries: list[tuple[type, Position, Any]]) -> list[type]:
    """Put each pass instance before/after its anchor type in upstream's insertion registry.
    Returns the anchors that had no registry entry before, for `remove_pass_insertions`."""
    module = _pass_manager_module()
    registry = module._registered_pass_insertions
    created = list(dict.fromkeys(a for a, _, _ in entries if a not in registry))
    for anchor_type, position, instance in entries:
        register = getattr(module, f"register_pass_insertions_{position}")
        register(anchor_type, [instance])
    return created


def remove_pass_insertions(entries: list[tuple[type, Position, Any]], created: list[type]) -> None:
    """Take exactly these instances out of upstream's registry again (others' entries stay),
    and drop the anchors `add_pass_insertions` created once they are empty."""
    registry = _pass_manager_module()._registered_pass_insertions
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


def are_arm_folds_registered() -> bool:
    return _installed is not None and _installed.insertions == ARM_PASS_INSERTIONS


def arm_folds_registered() -> ArmFoldsRegistration:
    """Register for a `with` block; leave registration as it was afterwards."""
    return register_arm_folds()


@contextlib.contextmanager
def upstream_folds_retired() -> Iterator[None]:
    """Neither upstream's retired passes nor etfold's run: the unfolded baseline for comparisons."""
    if _installed is not None:
        raise ArmRegistrationError("unregister etfold's Arm folds before retiring upstream's alone")
    _install(())
    try:
        yield
    finally:
        unregister_arm_folds()
