# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""etfold's XnnpackPartitioner: upstream's, plus the folds that let XNNPACK take more.

Drop-in: the same constructor arguments as upstream's, plus
- `fold_weights`: fold parameter-only GEMM weight subgraphs before decomposition
  (the weight-fold issue);
- `delegate_dtype_converts`: accept fp32 <-> fp16/bf16 converts of activations
  (the dtype-convert issue).
"""

from __future__ import annotations

import contextvars

from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from executorch.exir.backend.partitioner import PartitionResult
from executorch.exir.program._program import _default_decomposition_table
from torch.export import ExportedProgram

from etfold.backends.xnnpack._passes.dtype_convert_match import DtypeConvert, match_dtype_convert
from etfold.backends.xnnpack._passes.last_axis_ops_read_nchw import (
    LAYOUT_GUARD_SPEC,
    needs_layout_guard,
)
from etfold.backends.xnnpack.install import DTYPE_CONVERTS_SPEC, hold_for, is_marked
from etfold.backends.xnnpack.partition.bf16_delegation import (
    bf16_applies,
    bf16_scope,
    bf16_settings,
)
from etfold.backends.xnnpack.partition.config.convert_config import with_dtype_convert_configs
from etfold.backends.xnnpack.partition.config.dynamic_slice_config import (
    mark_dynamic_slice_partitions,
    with_dynamic_slice_config,
)
from etfold.backends.xnnpack.partition.constant_layout_conflicts import find_layout_conflicts
from etfold.backends.xnnpack.partition.dropped_copies import (
    clones_beside_their_source,
    clones_of_returned_values,
)
from etfold.backends.xnnpack.partition.marked_partitions import tags_holding, with_spec_on
from etfold.backends.xnnpack.partition.pre_decomposition_rewrites import run_rewrites
from etfold.backends.xnnpack.partition.shape_op_partitions import settle_shape_op_views
from etfold.backends.xnnpack.partition.weight_fold_ownership import own_folded_constants
from etfold.decisions import record_declined
from etfold.exir.program.lower import mark_for_lowering
from etfold.exir.program.method_marks import methods_judged
from etfold.exir.program.upstream_lowering import upstream_lowering_in_progress
from etfold.exir.program.working_copy import copy_for_rewrite

LAYOUT_FOLD = "xnnpack.constant_layout"
# readers kept out of partitions while one generate_partitions call re-draws them
_KEPT_OUT: contextvars.ContextVar[frozenset | set] = contextvars.ContextVar(
    "etfold_xnnpack_kept_out", default=frozenset()
)


def _raise_if_nothing_new(partitioner: str, kept_out_now: list, kept_out_before: set) -> None:
    """A round of re-partitioning must keep out a node no round kept out before: one
    that keeps out only nodes already kept out would be followed by the same round."""
    if kept_out_now and not set(kept_out_now) <= kept_out_before:
        return
    names = ", ".join(sorted({n.name for n in kept_out_now})) or "no node"
    raise RuntimeError(
        f"{partitioner}.generate_partitions: re-partitioning repeated itself: a round "
        f"kept out {names}, none of it new, so the next round would draw the same "
        "partitions; stopped instead of repeating forever"
    )


class XnnpackPartitioner(UpstreamXnnpackPartitioner):
    def __init__(
        self,
        configs=None,
        config_precisions=None,
        per_op_mode: bool = False,
        verbose: bool = False,
        *,
        fold_weights: bool = True,
        delegate_dtype_converts: bool = True,
        **kwargs,
    ):
        configs = with_dynamic_slice_config(list(configs or ALL_PARTITIONER_CONFIGS))
        if delegate_dtype_converts:
            configs = self._dtype_convert_configs(configs)
        super().__init__(configs, config_precisions, per_op_mode, verbose, **kwargs)
        self.fold_weights = fold_weights
        self.delegate_dtype_converts = delegate_dtype_converts
        # upstream's kwargs carry enable_bf16; absent means "not set" (bf16 follows the program)
        self._user_enable_bf16 = kwargs.get("enable_bf16")

    # ---- the pre-decomposition rewrites: weight fold, exact rewrites, layout guards
    def transform_for_pre_decomposition(self, exported_program: ExportedProgram) -> ExportedProgram:
        """Upstream's, then the rewrites this partitioner enables, in their declared
        order (`pre_decomposition_rewrites.PRE_DECOMPOSITION_REWRITES`)."""
        exported_program = super().transform_for_pre_decomposition(exported_program)
        return run_rewrites(self, exported_program)

    @staticmethod
    def _judged_across_methods(exported_program: ExportedProgram) -> ExportedProgram:
        """Inside upstream's `to_edge_transform_and_lower`, the marks etfold's entry point
        computes (which buffers another method writes, which constants several read),
        computed here on copies from every method of the call: the user's programs are
        only read. Already marked, or outside a lowering: the program as it came."""
        if methods_judged(exported_program):
            return exported_program
        lowering = upstream_lowering_in_progress()
        if lowering is None:
            return exported_program
        judged = copy_for_rewrite(exported_program)
        copies = {
            method: judged if method == lowering.method else copy_for_rewrite(program)
            for method, program in lowering.programs.items()
        }
        mark_for_lowering(copies)
        return judged

    def _decomposition_table(
        self, exported_program: ExportedProgram, lowerings: dict | None = None
    ) -> dict:
        """What the lowering will decompose: ExecuTorch's table (`lowerings` when given)
        less the ops kept for XNNPACK."""
        table = dict(lowerings) if lowerings is not None else _default_decomposition_table()
        for op in self.ops_to_not_decompose(exported_program)[0]:
            table.pop(op, None)
        return table

    # ---- end weight fold

    # ---- dtype converts: fp32 <-> fp16/bf16 converts of activations join delegates
    @staticmethod
    def _dtype_convert_configs(configs):
        return with_dtype_convert_configs(list(configs or ALL_PARTITIONER_CONFIGS))

    @staticmethod
    def _mark_convert_partitions(result: PartitionResult) -> PartitionResult:
        """The compile spec (it tells etfold's preprocess wrapper to rewrite converts) goes
        only on partitions holding a delegated convert; the others keep upstream's spec."""

        def holds_convert(nodes):
            return any(isinstance(match_dtype_convert(n), DtypeConvert) for n in nodes)

        return with_spec_on(result, tags_holding(result, holds_convert), DTYPE_CONVERTS_SPEC)

    def ops_to_not_decompose(self, ep: ExportedProgram):
        """Upstream's, with each kept-op check run under the bf16 settings partition() uses,
        so a bf16 linear stays linear exactly when it will be partitioned."""
        ops, keep = super().ops_to_not_decompose(ep)
        if keep is None or not bf16_applies(ep, self._user_enable_bf16):
            return ops, keep
        configs = list(self.target_partitioner_configs.values())

        def keep_under_bf16_settings(node) -> bool:
            with bf16_settings(configs, self._user_enable_bf16):
                return keep(node)

        return ops, keep_under_bf16_settings

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        configs = self.target_partitioner_configs.values()
        with bf16_scope(exported_program, self._user_enable_bf16, configs):
            result = settle_shape_op_views(super().partition(exported_program))
        result = own_folded_constants(result)
        if self.delegate_dtype_converts:
            result = self._mark_convert_partitions(result)
        result = mark_dynamic_slice_partitions(result)
        return self._held_until_preprocessed(self._mark_layout_guard_partitions(result))

    @staticmethod
    def _held_until_preprocessed(result: PartitionResult) -> PartitionResult:
        """A marked partition must never reach an unwrapped preprocess: one install hold
        per marked partition, on a ledger tied to the partitioned program (see install)."""
        marked = sum(is_marked(spec.compile_specs) for spec in result.partition_tags.values())
        hold_for(result.tagged_exported_program, marked)
        return result

    @staticmethod
    def _mark_layout_guard_partitions(result: PartitionResult) -> PartitionResult:
        """Partitions where a last-axis op may read NHWC data get the layout guard spec."""
        return with_spec_on(result, tags_holding(result, needs_layout_guard), LAYOUT_GUARD_SPEC)

    # ---- end dtype converts

    # ---- one serialized form per constant and delegate, one output per value
    def get_matched_nodes_from_configs(self, ep: ExportedProgram):
        groups = super().get_matched_nodes_from_configs(ep)
        kept_out = _KEPT_OUT.get()
        if not kept_out:
            return groups
        return [kept for group in groups if (kept := [n for n in group if n not in kept_out])]

    def generate_partitions(self, ep: ExportedProgram):
        """Upstream's partitions, re-drawn until no constant needs two forms in one delegate
        and no delegate would return a value beside its dropped copy.

        Each round that is not the last keeps out of the delegates at least one node no
        round kept out before, or raises `RuntimeError`: so there are at most as many
        rounds as the graph has nodes, plus the last."""
        kept_out: set = set(clones_of_returned_values(ep))
        token = _KEPT_OUT.set(kept_out)
        try:
            while True:
                partitions = super().generate_partitions(ep)
                conflicts = find_layout_conflicts(ep, (p.nodes for p in partitions))
                for conflict in conflicts:
                    record_declined(LAYOUT_FOLD, conflict.constant.name, conflict.reason)
                doubled = (
                    [] if conflicts else clones_beside_their_source(p.nodes for p in partitions)
                )
                if not conflicts and not doubled:
                    return partitions
                again = [n for c in conflicts for n in c.kept_out] + doubled
                _raise_if_nothing_new(type(self).__name__, again, kept_out)
                kept_out.update(again)
        finally:
            _KEPT_OUT.reset(token)
