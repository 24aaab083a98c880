# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Constant propagation over a lifted ExportedProgram, ATen or Edge dialect.

    n = op(c_1, ..., c_k)        every c_i a parameter, a lifted constant, an
                                 unmutated buffer (when fold_buffers), a literal
                                 or another folded node
      -> v = op(value(c_1), ..., value(c_k)) computed once, here;
         n becomes a constant placeholder holding v when something outside the
         fold reads it, and is erased otherwise.

A drop-in for upstream's `executorch.exir.passes.constant_prop_pass.constant_prop_pass`:
the same positional parameters and defaults, the same default skip targets (so a
dequantize of a constant weight folds in ATen dialect), upstream's names for the
new constants, and upstream's warning when the program holds control flow.
etfold's callers opt into more with keywords: an allowlist (`nodes_to_fold`),
`fold_buffers=False`, names and kinds that follow the sources
(`register_like_source`), and skipping by op family (`FILLS_AND_QUANT_OPS`).

A fold never runs where it would be wrong: a buffer the program writes, an impure,
random or allocating op, an op that raises or returns a non-tensor all stay as
they are, each with its reason recorded (`etfold.decisions`). The phases live in
`etfold.exir.passes.constant_prop`: select, evaluate, name, rewrite.
"""

from __future__ import annotations

import logging

from torch.export import ExportedProgram

from etfold.decisions import Declined, record_declined
from etfold.exir.passes.constant_prop import FOLD
from etfold.exir.passes.constant_prop.evaluate import evaluate_selection
from etfold.exir.passes.constant_prop.name import (
    ConstantFolds,
    Materialization,
    fold_expression,
    name_folds,
)
from etfold.exir.passes.constant_prop.rewrite import rewrite_constant_folds
from etfold.exir.passes.constant_prop.select import (
    CONTROL_FLOW_WARNING,
    has_control_flow,
    select_folds,
)
from etfold.exir.passes.constant_prop.verdicts import (
    FILLS_AND_QUANT_OPS,
    SkipFamilies,
    SkipTargets,
)

__all__ = [
    "FILLS_AND_QUANT_OPS",
    "FOLD",
    "ConstantFolds",
    "Materialization",
    "SkipFamilies",
    "constant_prop_pass",
    "fold_expression",
    "match_constant_folds",
    "rewrite_constant_folds",
]


def match_constant_folds(
    exported_program: ExportedProgram,
    custom_skip_targets: SkipTargets = None,
    *,
    nodes_to_fold=None,
    fold_buffers: bool = True,
    register_like_source: bool = False,
) -> ConstantFolds | Declined:
    """Select, evaluate and name the folds; the program is not modified."""
    selection = select_folds(
        exported_program,
        custom_skip_targets,
        nodes_to_fold=nodes_to_fold,
        fold_buffers=fold_buffers,
    )
    evaluation = evaluate_selection(selection)
    return name_folds(
        exported_program,
        selection,
        evaluation,
        register_like_source=register_like_source,
        fold_buffers=fold_buffers,
    )


def constant_prop_pass(
    exported_program: ExportedProgram,
    custom_skip_targets: SkipTargets = None,
    _skip_dim_order: bool = True,
    *,
    nodes_to_fold=None,
    fold_buffers: bool = True,
    register_like_source: bool = False,
) -> ExportedProgram:
    """Fold every allowed call_function node whose inputs are all constants.

    custom_skip_targets: ops never folded. None: upstream's default (Edge `full`
        and the Edge quantization primitives). A collection of targets replaces
        it; `FILLS_AND_QUANT_OPS` skips fill-only factories and quantization ops
        in every dialect. Impure, nondeterministic and allocation ops never fold.
    _skip_dim_order: in Edge dialect, a constant returned as an output is cloned
        with `aten.clone` (True) or `dim_order_ops._clone_dim_order` (False).
    nodes_to_fold: an allowlist of nodes (or node names); nothing outside it folds.
    fold_buffers: whether unmutated buffers count as constants.
    register_like_source: name and register folds like their sources
        (`etfold.exir.passes.constant_prop.name`).

    Mutates and returns `exported_program`; returns it untouched when nothing folds.
    """
    if not exported_program.graph.find_nodes(op="placeholder"):
        return exported_program
    if has_control_flow(exported_program.graph):
        record_declined(FOLD, "<program>", CONTROL_FLOW_WARNING, level=logging.WARNING)
    folds = match_constant_folds(
        exported_program,
        custom_skip_targets,
        nodes_to_fold=nodes_to_fold,
        fold_buffers=fold_buffers,
        register_like_source=register_like_source,
    )
    if isinstance(folds, Declined):
        return exported_program
    return rewrite_constant_folds(exported_program, folds, skip_dim_order=_skip_dim_order)
