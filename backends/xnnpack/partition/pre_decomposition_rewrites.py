# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The rewrites etfold's XnnpackPartitioner runs before decomposition, declared.

Each entry states what it needs and what must run before it:
- `settings`: the partitioner flags that enable it (any of them; none: always);
- `configs`: the partitioner config targets its rewritten ops need, all present;
- `graph_mode_only`: skipped in per-op mode, where a rewritten op would join no
  delegate (one delegate per op);
- `bf16_ops`: the config targets whose bf16 setting its rewritten ops run with;
- `reads_table`: it reads the lowering's decomposition table (less the kept ops);
- `after`: the rewrites that must run before it, each with why.

`run_rewrites` runs the enabled entries in the declared order; `check_order` (run
on import) fails when an entry names a rewrite that is not declared before it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from executorch.exir.program._program import _default_decomposition_table
from torch.export import ExportedProgram

from etfold.backends.xnnpack._passes.and_all_true_as_other_operand_pass import (
    ands_all_true_as_other_operand,
)
from etfold.backends.xnnpack._passes.attention_mask_all_true_pass import (
    attention_masks_all_true_dropped,
)
from etfold.backends.xnnpack._passes.attention_mask_unexpanded_pass import (
    attention_masks_unexpanded,
)
from etfold.backends.xnnpack._passes.attention_scores_in_bmm_shape_pass import (
    attention_scores_in_bmm_shape,
)
from etfold.backends.xnnpack._passes.causal_attention_as_mask_pass import (
    causal_attentions_as_masks,
)
from etfold.backends.xnnpack._passes.clamp_chains_as_one_pass import clamp_chains_as_one
from etfold.backends.xnnpack._passes.contiguous_last_axis_inputs_pass import (
    read_last_axis_normalizations_contiguous,
)
from etfold.backends.xnnpack._passes.conv_tail_slices_as_padding_pass import (
    conv_tail_slices_as_padding,
)
from etfold.backends.xnnpack._passes.decomposed_first import decompositions_shared
from etfold.backends.xnnpack._passes.elementwise_before_slices_pass import (
    delegated_elementwise_ops,
    elementwise_ops_before_slices,
)
from etfold.backends.xnnpack._passes.embedding_of_one_index_as_row_pass import (
    embeddings_of_one_index_as_rows,
)
from etfold.backends.xnnpack._passes.embedding_of_positions_as_table_slice_pass import (
    embeddings_of_positions_as_table_slices,
)
from etfold.backends.xnnpack._passes.expand_as_delegated_ops_pass import (
    BROADCASTING_OPS,
    COPY_TARGETS,
    expands_as_delegated_ops,
)
from etfold.backends.xnnpack._passes.gemm_with_constant_operand_as_linear_pass import (
    gemms_with_constant_operands_as_linear,
)
from etfold.backends.xnnpack._passes.index_by_aranges_as_view_pass import (
    index_by_aranges_as_view,
)
from etfold.backends.xnnpack._passes.last_dim_unbind_and_stack_transposed_pass import (
    last_dim_unbinds_and_stacks_transposed,
)
from etfold.backends.xnnpack._passes.layer_norm_as_delegated_ops_pass import (
    DELEGATED_TARGETS,
    POOLED_MEAN_TARGETS,
    layer_norms_as_delegated_ops,
)
from etfold.backends.xnnpack._passes.mean_over_last_dim_as_pooling_pass import (
    means_over_last_dim_as_pooling,
)
from etfold.backends.xnnpack._passes.mul_scalar_as_tensor_pass import mul_scalars_as_tensors
from etfold.backends.xnnpack._passes.number_operands_as_constants_pass import (
    number_operands_as_constants,
)
from etfold.backends.xnnpack._passes.pow_of_small_integer_as_multiplies_pass import (
    pows_of_small_integers_as_multiplies,
)
from etfold.backends.xnnpack._passes.reduction_over_adjacent_dims_as_pooling_pass import (
    reductions_over_adjacent_dims_as_pooling,
)
from etfold.backends.xnnpack._passes.safe_softmax_as_softmax_pass import (
    safe_softmaxes_as_softmax,
)
from etfold.backends.xnnpack._passes.safe_softmax_guard_from_mask_pass import (
    safe_softmax_guards_from_masks,
)
from etfold.backends.xnnpack._passes.scalar_tensor_as_constant_pass import (
    scalar_tensors_as_constants,
)
from etfold.backends.xnnpack._passes.shape_ops_as_views_pass import (
    delegated_op_names,
    shape_ops_as_views,
)
from etfold.backends.xnnpack._passes.size_only_values_as_table_slices_pass import (
    size_only_values_as_table_slices,
)
from etfold.backends.xnnpack._passes.split_as_slices_pass import splits_as_slices
from etfold.backends.xnnpack._passes.where_as_leaky_relu_or_clamp_pass import (
    wheres_as_leaky_relu_or_clamp,
)
from etfold.backends.xnnpack._passes.widen_half_precision_ops_pass import widen_half_precision_ops
from etfold.backends.xnnpack.partition.bf16_delegation import bf16_applies, bf16_setting
from etfold.backends.xnnpack.partition.weight_fold import fold_gemm_weights
from etfold.backends.xnnpack.partition.weight_fold_seeds import seed_slots
from etfold.exir.passes.inline_autocast_regions_pass import inline_autocast_regions
from etfold.exir.passes.own_constants_before_batch_norm_fusion_pass import (
    own_constants_before_batch_norm_fusion,
)
from etfold.exir.passes.size_min_max_decided_over_the_bounds_pass import (
    size_min_max_decided_over_the_bounds,
)


@dataclass(frozen=True)
class RewriteInputs:
    """What one rewrite reads besides the program: the partitioner, whether its ops
    run in bf16 here, and the decomposition table (None unless it declares it reads it)."""

    partitioner: object
    bf16: bool
    table: dict | None


@dataclass(frozen=True)
class PreDecompositionRewrite:
    name: str
    run: Callable[[ExportedProgram, RewriteInputs], ExportedProgram]
    settings: tuple[str, ...] = ()
    configs: frozenset[str] = frozenset()
    graph_mode_only: bool = False
    bf16_ops: tuple[str, ...] = ()
    reads_table: bool = False
    after: tuple[tuple[str, str], ...] = ()  # (rewrite, why it must run first)

    def enabled(self, partitioner) -> bool:
        """Whether `partitioner`'s flags, mode and configs call for this rewrite."""
        if self.settings and not any(getattr(partitioner, s) for s in self.settings):
            return False
        if self.graph_mode_only and partitioner.per_op_mode:
            return False
        return self.configs <= partitioner.target_partitioner_configs.keys()


def _configs(inputs: RewriteInputs):
    return inputs.partitioner.target_partitioner_configs


def _fold_weights(program: ExportedProgram, inputs: RewriteInputs) -> ExportedProgram:
    slots = seed_slots(_configs(inputs).values())
    return fold_gemm_weights(program, slots, inputs.table)


def _expands(program: ExportedProgram, inputs: RewriteInputs) -> ExportedProgram:
    broadcasting = [op for op, target in BROADCASTING_OPS.items() if target in _configs(inputs)]
    return expands_as_delegated_ops(program, inputs.table, broadcasting, bf16=inputs.bf16)


def _elementwise_before_slices(program: ExportedProgram, inputs: RewriteInputs) -> ExportedProgram:
    ops = delegated_elementwise_ops(_configs(inputs).keys())
    return elementwise_ops_before_slices(program, ops, bf16=inputs.bf16)


def _shape_ops(program: ExportedProgram, inputs: RewriteInputs) -> ExportedProgram:
    delegated = delegated_op_names(_configs(inputs))
    return shape_ops_as_views(program, delegated, bf16=inputs.bf16)


_ROWS_AND_TRANSPOSE = ("permute_copy.default", "cat.default", "slice_copy.Tensor")
_MARKS = ("judged_across_methods", "reads the marks of constants other methods read or write")

PRE_DECOMPOSITION_REWRITES: tuple[PreDecompositionRewrite, ...] = (
    PreDecompositionRewrite(
        "judged_across_methods",
        lambda program, inputs: inputs.partitioner._judged_across_methods(program),
    ),
    PreDecompositionRewrite(
        "own_constants_before_batch_norm_fusion",
        lambda program, _: own_constants_before_batch_norm_fusion(program),
    ),
    PreDecompositionRewrite(
        "clamp_chains_as_one",
        lambda program, _: clamp_chains_as_one(program),
    ),
    PreDecompositionRewrite(
        "inline_autocast_regions",
        lambda program, _: inline_autocast_regions(program),
        settings=("fold_weights", "delegate_dtype_converts"),
    ),
    PreDecompositionRewrite(
        "widen_half_precision_ops",
        lambda program, _: widen_half_precision_ops(program),
        settings=("delegate_dtype_converts",),
        after=(("inline_autocast_regions", "sees the half-precision ops autocast regions hold"),),
    ),
    PreDecompositionRewrite(
        "read_last_axis_normalizations_contiguous",
        lambda program, _: read_last_axis_normalizations_contiguous(program),
    ),
    PreDecompositionRewrite(
        "gemms_with_constant_operands_as_linear",
        lambda program, inputs: gemms_with_constant_operands_as_linear(program, bf16=inputs.bf16),
        configs=frozenset({"linear.default"}),
        graph_mode_only=True,
        bf16_ops=("linear.default",),
        # before the size-only tables, which would table a constant broadcast to a dynamic batch
        after=(
            _MARKS,
            ("inline_autocast_regions", "sees the GEMMs autocast regions hold"),
            ("widen_half_precision_ops", "a widened bf16 matmul reads its weight converted"),
        ),
    ),
    PreDecompositionRewrite(
        "embeddings_of_one_index_as_rows",
        lambda program, _: embeddings_of_one_index_as_rows(program),
        # before the weight fold, which copies a buffer it reads into one unjudged
        after=(_MARKS,),
    ),
    PreDecompositionRewrite(
        "embeddings_of_positions_as_table_slices",
        lambda program, _: embeddings_of_positions_as_table_slices(program),
        # before the weight fold, which copies a buffer it reads into one unjudged
        after=(_MARKS,),
    ),
    PreDecompositionRewrite(
        "causal_attentions_as_masks",
        lambda program, _: causal_attentions_as_masks(program),
    ),
    PreDecompositionRewrite(
        "index_by_aranges_as_view",
        lambda program, _: index_by_aranges_as_view(program),
        after=(_MARKS,),
    ),
    PreDecompositionRewrite(
        "ands_all_true_as_other_operand",
        lambda program, _: ands_all_true_as_other_operand(program),
        after=(_MARKS,),
    ),
    PreDecompositionRewrite(
        "attention_masks_all_true_dropped",
        lambda program, _: attention_masks_all_true_dropped(program),
        # before the weight fold, whose decomposition writes SDPA out
        after=(
            _MARKS,
            ("ands_all_true_as_other_operand", "a mask & True is the mask this checks"),
        ),
    ),
    PreDecompositionRewrite(
        "attention_masks_unexpanded",
        lambda program, _: attention_masks_unexpanded(program),
        # before the weight fold, whose decomposition writes SDPA out
        after=(
            (
                "ands_all_true_as_other_operand",
                "the & with True is dropped through the expand this drops",
            ),
        ),
    ),
    PreDecompositionRewrite(
        "size_only_values_as_table_slices",
        lambda program, _: size_only_values_as_table_slices(program),
        # before the weight fold, whose decomposition writes the attention's mask out
        after=(
            _MARKS,
            ("embeddings_of_positions_as_table_slices", "slices the table it reads, no copy"),
            ("index_by_aranges_as_view", "a view of the mask needs no table"),
            ("attention_masks_all_true_dropped", "a mask dropped needs no table"),
            ("attention_masks_unexpanded", "tables the mask, not its expanded copy"),
            ("causal_attentions_as_masks", "tables the mask a causal attention stands for"),
        ),
    ),
    PreDecompositionRewrite(
        "fold_gemm_weights",
        _fold_weights,
        settings=("fold_weights",),
        reads_table=True,
        after=(
            _MARKS,
            ("inline_autocast_regions", "folds the weights autocast regions read"),
            ("causal_attentions_as_masks", "folds the mask a causal attention stands for"),
        ),
    ),
    PreDecompositionRewrite(
        "safe_softmaxes_as_softmax",
        lambda program, inputs: safe_softmaxes_as_softmax(program, inputs.table),
        configs=frozenset({"_softmax.default"}),
        graph_mode_only=True,
        reads_table=True,
        after=(_MARKS,),
    ),
    PreDecompositionRewrite(
        "safe_softmax_guards_from_masks",
        lambda program, inputs: safe_softmax_guards_from_masks(program, inputs.table),
        configs=frozenset({"_softmax.default", "mul.Tensor"}),
        graph_mode_only=True,
        reads_table=True,
        after=(("safe_softmaxes_as_softmax", "drops the guards no row needs, before any is kept"),),
    ),
    PreDecompositionRewrite(
        "attention_scores_in_bmm_shape",
        lambda program, inputs: attention_scores_in_bmm_shape(program, inputs.table),
        configs=frozenset({"bmm.default", "_softmax.default"}),
        graph_mode_only=True,
        reads_table=True,
        after=(
            ("safe_softmaxes_as_softmax", "the guard, dropped, leaves softmax the chain's end"),
            ("safe_softmax_guards_from_masks", "the guard, a multiply, keeps the chain whole"),
        ),
    ),
    PreDecompositionRewrite(
        "expands_as_delegated_ops",
        _expands,
        configs=frozenset(COPY_TARGETS),
        graph_mode_only=True,
        bf16_ops=("cat.default",),
        reads_table=True,
        after=(("safe_softmaxes_as_softmax", "it decomposes SDPA, whose expands this sees"),),
    ),
    PreDecompositionRewrite(
        "last_dim_unbinds_and_stacks_transposed",
        lambda program, inputs: last_dim_unbinds_and_stacks_transposed(program, bf16=inputs.bf16),
        configs=frozenset(_ROWS_AND_TRANSPOSE),
        graph_mode_only=True,
        bf16_ops=_ROWS_AND_TRANSPOSE,
    ),
    PreDecompositionRewrite(
        "shape_ops_as_views",
        _shape_ops,
        configs=frozenset({"view_copy.default"}),
        graph_mode_only=True,
        bf16_ops=("view_copy.default",),
        after=(
            ("expands_as_delegated_ops", "an unsqueeze beside an expand joins no delegate"),
            ("last_dim_unbinds_and_stacks_transposed", "views the rows it unsqueezes"),
        ),
    ),
    PreDecompositionRewrite(
        "layer_norms_as_delegated_ops",
        lambda program, inputs: layer_norms_as_delegated_ops(
            program,
            bf16=inputs.bf16,
            pooled_means=set(POOLED_MEAN_TARGETS) <= _configs(inputs).keys(),
            pooled_bf16=ops_run_in_bf16(POOLED_MEAN_TARGETS, inputs.partitioner, program),
        ),
        configs=frozenset(DELEGATED_TARGETS),
        graph_mode_only=True,
        bf16_ops=DELEGATED_TARGETS,
        after=(
            (
                "read_last_axis_normalizations_contiguous",
                "a channels-last norm reads its contiguous copy",
            ),
        ),
    ),
    PreDecompositionRewrite(
        "reductions_over_adjacent_dims_as_pooling",
        lambda program, inputs: reductions_over_adjacent_dims_as_pooling(program, bf16=inputs.bf16),
        configs=frozenset({"mean.dim", "view_copy.default", "permute_copy.default"}),
        graph_mode_only=True,
        bf16_ops=("mean.dim", "permute_copy.default", "mul.Tensor"),
        after=(("widen_half_precision_ops", "sees the bf16 means it widens to float32"),),
    ),
    PreDecompositionRewrite(
        "means_over_last_dim_as_pooling",
        lambda program, inputs: means_over_last_dim_as_pooling(program, bf16=inputs.bf16),
        configs=frozenset({"mean.dim", "view_copy.default"}),
        graph_mode_only=True,
        bf16_ops=("mean.dim",),
        after=(
            (
                "layer_norms_as_delegated_ops",
                "writes the means of a norm over a symbolic width as pooling",
            ),
            (
                "reductions_over_adjacent_dims_as_pooling",
                "writes the means over a last block of dims as pooling",
            ),
        ),
    ),
    PreDecompositionRewrite(
        "splits_as_slices",
        lambda program, inputs: splits_as_slices(program, bf16=inputs.bf16),
        configs=frozenset({"slice_copy.Tensor"}),
        bf16_ops=("slice_copy.Tensor",),
        after=(("last_dim_unbinds_and_stacks_transposed", "slices the rows, not the columns"),),
    ),
    PreDecompositionRewrite(
        "elementwise_ops_before_slices",
        _elementwise_before_slices,
        configs=frozenset({"slice_copy.Tensor"}),
        bf16_ops=("slice_copy.Tensor",),
        after=(("splits_as_slices", "sees a recurrent cell's gates as slices"),),
    ),
    PreDecompositionRewrite(
        "conv_tail_slices_as_padding",
        lambda program, _: conv_tail_slices_as_padding(program),
        configs=frozenset({"constant_pad_nd.default", "convolution.default"}),
        graph_mode_only=True,
    ),
    PreDecompositionRewrite(
        "wheres_as_leaky_relu_or_clamp",
        lambda program, inputs: wheres_as_leaky_relu_or_clamp(program, bf16=inputs.bf16),
        configs=frozenset({"leaky_relu.default", "clamp.default"}),
        bf16_ops=("leaky_relu.default", "clamp.default"),
    ),
    PreDecompositionRewrite(
        "pows_of_small_integers_as_multiplies",
        lambda program, inputs: pows_of_small_integers_as_multiplies(program, bf16=inputs.bf16),
        configs=frozenset({"mul.Tensor"}),
        bf16_ops=("mul.Tensor",),
    ),
    PreDecompositionRewrite(
        "mul_scalars_as_tensors",
        lambda program, inputs: mul_scalars_as_tensors(program, inputs.table, bf16=inputs.bf16),
        configs=frozenset({"mul.Tensor"}),
        bf16_ops=("mul.Tensor",),
        reads_table=True,
    ),
    PreDecompositionRewrite(
        "scalar_tensors_as_constants",
        lambda program, inputs: scalar_tensors_as_constants(program, inputs.table),
        reads_table=True,
        after=(("fold_gemm_weights", "folds a constant mask's whole conversion, scalars and all"),),
    ),
    PreDecompositionRewrite(
        "number_operands_as_constants",
        lambda program, inputs: number_operands_as_constants(program, inputs.table),
        reads_table=True,
        after=(("mul_scalars_as_tensors", "its mul.Tensor reads a number this lifts"),),
    ),
    PreDecompositionRewrite(
        "size_min_max_decided_over_the_bounds",
        lambda program, _: size_min_max_decided_over_the_bounds(program),
    ),
)


class RewriteOrderError(RuntimeError):
    """A declared rewrite needs one that is not declared before it."""


def check_order(rewrites: Sequence[PreDecompositionRewrite]) -> None:
    seen: set[str] = set()
    for rewrite in rewrites:
        if rewrite.name in seen:
            raise RewriteOrderError(f"`{rewrite.name}` is declared twice")
        for before, why in rewrite.after:
            if before not in seen:
                raise RewriteOrderError(
                    f"`{rewrite.name}` must run after `{before}` ({why}), "
                    "which is not declared before it"
                )
        seen.add(rewrite.name)


check_order(PRE_DECOMPOSITION_REWRITES)


def run_rewrites(
    partitioner,
    program: ExportedProgram,
    rewrites: Sequence[PreDecompositionRewrite] = PRE_DECOMPOSITION_REWRITES,
) -> ExportedProgram:
    """`program` through every rewrite `partitioner` enables, in the declared order."""
    # ExecuTorch's table, built at most once per call: building it walks every composite op
    lowerings = functools.cache(lambda: dict(_default_decomposition_table().items()))
    with decompositions_shared():
        for rewrite in rewrites:
            if not rewrite.enabled(partitioner):
                continue
            table = (
                partitioner._decomposition_table(program, lowerings())
                if rewrite.reads_table
                else None
            )
            inputs = RewriteInputs(partitioner, runs_in_bf16(rewrite, partitioner, program), table)
            program = rewrite.run(program, inputs)
    return program


def runs_in_bf16(rewrite: PreDecompositionRewrite, partitioner, program: ExportedProgram) -> bool:
    """The rewrite's ops run in bf16 (`ops_run_in_bf16` of its `bf16_ops`)."""
    return ops_run_in_bf16(rewrite.bf16_ops, partitioner, program)


def ops_run_in_bf16(ops: tuple[str, ...], partitioner, program: ExportedProgram) -> bool:
    """bf16 applies to the program, and the lowering enables bf16 for each of `ops`."""
    user_bf16 = partitioner._user_enable_bf16
    if not ops or not bf16_applies(program, user_bf16):
        return False
    return all(bf16_setting(op, user_bf16) for op in ops)
