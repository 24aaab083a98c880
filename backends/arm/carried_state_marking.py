# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Write-backs marked as carried state before Arm's pipelines see the program.

A backend pass sees only its delegate, where a value written back to a buffer
or an input looks like an ordinary output. Upstream's (empty)
`ArmPassManager.transform_for_pre_decomposition_pipeline` is the one point that
sees the whole program before partitioning; while etfold's folds are registered
it runs on a marked copy of what it is handed (the user's own program), which
upstream lowers from then on.
"""

from __future__ import annotations

from collections.abc import Callable


def marked_copy(exported_program):
    """A copy of the program upstream handed in with its write-backs marked as carried
    state, batch norms given constants of their own and folded into a linear before
    them where Arm's fusion cannot. Every node gets its own `custom` dict: decomposition
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


def on_a_marked_copy(original: Callable) -> Callable:
    """`transform_for_pre_decomposition_pipeline`, run on `marked_copy` of its program."""

    def transform_for_pre_decomposition_pipeline(self, exported_program):
        return original(self, marked_copy(exported_program))

    transform_for_pre_decomposition_pipeline.__etfold_wrapped__ = original  # type: ignore[attr-defined]
    return transform_for_pre_decomposition_pipeline
