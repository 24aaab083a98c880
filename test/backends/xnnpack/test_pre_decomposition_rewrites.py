# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The partitioner's pre-decomposition rewrites: their declared order, what enables
each, and what each is handed."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack.partition.pre_decomposition_rewrites import (
    PRE_DECOMPOSITION_REWRITES,
    PreDecompositionRewrite,
    RewriteOrderError,
    check_order,
    run_rewrites,
)

DECLARED = [
    "judged_across_methods",
    "own_constants_before_batch_norm_fusion",
    "clamp_chains_as_one",
    "inline_autocast_regions",
    "widen_half_precision_ops",
    "read_last_axis_normalizations_contiguous",
    "gemms_with_constant_operands_as_linear",
    "embeddings_of_one_index_as_rows",
    "embeddings_of_positions_as_table_slices",
    "causal_attentions_as_masks",
    "index_by_aranges_as_view",
    "ands_all_true_as_other_operand",
    "attention_masks_all_true_dropped",
    "attention_masks_unexpanded",
    "size_only_values_as_table_slices",
    "fold_gemm_weights",
    "safe_softmaxes_as_softmax",
    "safe_softmax_guards_from_masks",
    "attention_scores_in_bmm_shape",
    "expands_as_delegated_ops",
    "last_dim_unbinds_and_stacks_transposed",
    "shape_ops_as_views",
    "layer_norms_as_delegated_ops",
    "reductions_over_adjacent_dims_as_pooling",
    "means_over_last_dim_as_pooling",
    "splits_as_slices",
    "elementwise_ops_before_slices",
    "conv_tail_slices_as_padding",
    "wheres_as_leaky_relu_or_clamp",
    "pows_of_small_integers_as_multiplies",
    "mul_scalars_as_tensors",
    "scalar_tensors_as_constants",
    "number_operands_as_constants",
    "size_min_max_decided_over_the_bounds",
]
GRAPH_MODE_ONLY = {
    "gemms_with_constant_operands_as_linear",
    "safe_softmaxes_as_softmax",
    "safe_softmax_guards_from_masks",
    "attention_scores_in_bmm_shape",
    "expands_as_delegated_ops",
    "last_dim_unbinds_and_stacks_transposed",
    "shape_ops_as_views",
    "layer_norms_as_delegated_ops",
    "reductions_over_adjacent_dims_as_pooling",
    "means_over_last_dim_as_pooling",
    "conv_tail_slices_as_padding",
}


def _names(rewrites) -> list[str]:
    return [rewrite.name for rewrite in rewrites]


def _enabled(partitioner) -> list[str]:
    return [r.name for r in PRE_DECOMPOSITION_REWRITES if r.enabled(partitioner)]


def test_the_rewrites_run_in_the_declared_order_each_after_what_it_needs():
    assert _names(PRE_DECOMPOSITION_REWRITES) == DECLARED
    position = {name: index for index, name in enumerate(DECLARED)}
    for rewrite in PRE_DECOMPOSITION_REWRITES:
        for before, why in rewrite.after:
            assert position[before] < position[rewrite.name] and why
    needs = {(r.name, before) for r in PRE_DECOMPOSITION_REWRITES for before, _ in r.after}
    assert {
        ("expands_as_delegated_ops", "safe_softmaxes_as_softmax"),
        ("shape_ops_as_views", "expands_as_delegated_ops"),
        ("shape_ops_as_views", "last_dim_unbinds_and_stacks_transposed"),
        ("splits_as_slices", "last_dim_unbinds_and_stacks_transposed"),
        ("means_over_last_dim_as_pooling", "layer_norms_as_delegated_ops"),
    } <= needs


def test_a_rewrite_declared_before_what_it_needs_is_refused():
    rewrites = list(PRE_DECOMPOSITION_REWRITES)
    means = DECLARED.index("means_over_last_dim_as_pooling")
    norms = DECLARED.index("layer_norms_as_delegated_ops")
    rewrites[means], rewrites[norms] = rewrites[norms], rewrites[means]
    with pytest.raises(RewriteOrderError, match="`means_over_last_dim_as_pooling` must run after"):
        check_order(rewrites)
    with pytest.raises(RewriteOrderError, match="declared twice"):
        check_order([*PRE_DECOMPOSITION_REWRITES, PRE_DECOMPOSITION_REWRITES[0]])


def test_a_default_partitioner_enables_every_rewrite():
    assert _enabled(XnnpackPartitioner()) == DECLARED


def test_per_op_mode_skips_the_rewrites_whose_ops_would_join_no_delegate():
    enabled = _enabled(XnnpackPartitioner(per_op_mode=True))
    assert enabled == [name for name in DECLARED if name not in GRAPH_MODE_ONLY]


def test_the_partitioners_flags_enable_their_rewrites():
    neither = _enabled(XnnpackPartitioner(fold_weights=False, delegate_dtype_converts=False))
    assert not {"inline_autocast_regions", "widen_half_precision_ops", "fold_gemm_weights"} & set(
        neither
    )
    folds_only = _enabled(XnnpackPartitioner(delegate_dtype_converts=False))
    assert {"inline_autocast_regions", "fold_gemm_weights"} <= set(folds_only)
    assert "widen_half_precision_ops" not in folds_only


@pytest.mark.parametrize(
    ("missing", "skipped"),
    [
        (
            "_softmax.default",
            {
                "safe_softmaxes_as_softmax",
                "safe_softmax_guards_from_masks",
                "attention_scores_in_bmm_shape",
            },
        ),
        (
            "mean.dim",
            {"reductions_over_adjacent_dims_as_pooling", "means_over_last_dim_as_pooling"},
        ),
        (
            "linear.default",
            {"layer_norms_as_delegated_ops", "gemms_with_constant_operands_as_linear"},
        ),
        (
            "slice_copy.Tensor",
            {
                "last_dim_unbinds_and_stacks_transposed",
                "splits_as_slices",
                "elementwise_ops_before_slices",
            },
        ),
        (
            "permute_copy.default",
            {"last_dim_unbinds_and_stacks_transposed", "reductions_over_adjacent_dims_as_pooling"},
        ),
    ],
)
def test_a_rewrite_whose_configs_are_missing_is_skipped(missing, skipped):
    configs = [c for c in ALL_PARTITIONER_CONFIGS if c.target_name != missing]
    enabled = _enabled(XnnpackPartitioner(configs=configs))
    assert enabled == [name for name in DECLARED if name not in skipped]


class Doubled(torch.nn.Module):
    def forward(self, x):
        return x.mean(-1, keepdim=True) * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_rewrite_is_handed_the_table_it_declares_and_its_bf16_setting(dtype):
    """Recording stand-ins for every declared rewrite: run in order, each sees the
    program the one before returned, a table only when it reads one, and bf16 only
    for a bf16 program whose lowering enables bf16 for its ops."""
    program = torch.export.export(Doubled().to(dtype), (torch.randn(2, 4).to(dtype),))
    partitioner = XnnpackPartitioner()  # bf16 follows the program
    seen = []

    def recording(rewrite: PreDecompositionRewrite):
        def run(received, inputs):
            seen.append((rewrite.name, received is program, inputs.table is not None, inputs.bf16))
            return received

        return dataclasses.replace(rewrite, run=run)

    stand_ins = [recording(r) for r in PRE_DECOMPOSITION_REWRITES]
    assert run_rewrites(partitioner, program, stand_ins) is program
    assert [name for name, *_ in seen] == DECLARED
    for rewrite, (_, same, has_table, bf16) in zip(PRE_DECOMPOSITION_REWRITES, seen, strict=True):
        assert same and has_table == rewrite.reads_table
        assert not bf16 or (dtype is torch.bfloat16 and rewrite.bf16_ops), rewrite.name
    in_bf16 = {name for name, *_, bf16 in seen if bf16}
    # mul, sub, cat, permute, view, slice, linear, rsqrt, clamp and leaky ReLU run in bf16
    # on XNNPACK 1.5.1; mean does not
    expected = {
        "gemms_with_constant_operands_as_linear",
        "layer_norms_as_delegated_ops",
        "wheres_as_leaky_relu_or_clamp",
        "pows_of_small_integers_as_multiplies",
        "expands_as_delegated_ops",
        "last_dim_unbinds_and_stacks_transposed",
        "shape_ops_as_views",
        "splits_as_slices",
        "elementwise_ops_before_slices",
        "mul_scalars_as_tensors",
    }
    assert in_bf16 == (expected if dtype is torch.bfloat16 else set())
