# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Batch norms that fuse into no layer and share a weight (gamma) each read a gamma of
their own before XNNPACK decomposes them (`own_constants_before_batch_norm_fusion`).

Stock XNNPACK names a decomposed batch norm's constants after its gamma: two norms
sharing a gamma with other statistics compute with one norm's values (0.63 off eager
here), and one BatchNorm1d applied to two rank-2 tensors fails in Conv1dUnsqueezePass.
"""

from __future__ import annotations

import torch
from torch import nn

from etfold.backends.arm import arm_folds_registered
from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower
from etfold.exir.passes.own_constants_before_batch_norm_fusion_pass import (
    FOLD,
    GAMMA,
    GAMMA_DETAIL,
    is_inference_batch_norm,
    own_constants_before_batch_norm_fusion,
)
from etfold.harness.tosa_runner import FP, lower_module_tosa
from etfold.harness.xnnpack_runner import lower_module_xnnpack


def _batch_norm(channels: int) -> nn.BatchNorm2d:
    norm = nn.BatchNorm2d(channels)
    with torch.no_grad():
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
        norm.weight.uniform_(0.5, 2)
        norm.bias.uniform_(-1, 1)
    return norm


class NormsSharingGamma(nn.Module):
    """Two batch norms after a relu (nothing to fuse into): one gamma, other statistics."""

    def __init__(self):
        super().__init__()
        self.first, self.second = _batch_norm(4), _batch_norm(4)
        self.second.weight = self.first.weight

    def forward(self, x):
        y = torch.relu(x)
        return self.first(y), self.second(y)


class OneNormTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x, y):
        return self.norm(x), self.norm(y)


def _relative_error(actual, reference) -> float:
    scale = max(float(r.abs().max()) for r in reference)
    return max(float((a - r).abs().max()) for a, r in zip(actual, reference, strict=True)) / scale


def _norms_sharing_gamma():
    torch.manual_seed(0)
    return NormsSharingGamma().eval(), (torch.randn(1, 4, 5, 5),)


def test_each_norm_but_the_last_reads_a_gamma_of_its_own():
    model, inputs = _norms_sharing_gamma()
    program = torch.export.export(model, inputs)
    with collect_decisions() as decisions:
        rewritten = own_constants_before_batch_norm_fusion(program)
    norms = [n for n in rewritten.graph.nodes if is_inference_batch_norm(n)]
    gammas = [norm.args[GAMMA] for norm in norms]
    assert len(norms) == 2 and len(set(gammas)) == 2
    assert all(len(gamma.users) == 1 for gamma in gammas)
    (applied,) = [d for d in decisions if d.fold == FOLD and d.applied]
    assert applied.detail == GAMMA_DETAIL
    shared = [n for n in program.graph.nodes if is_inference_batch_norm(n)]
    assert len({norm.args[GAMMA] for norm in shared}) == 1  # the user's program as it was


def test_xnnpack_norms_sharing_gamma_match_eager():
    model, inputs = _norms_sharing_gamma()
    program, reference = lower_module_xnnpack(
        model, inputs, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
    )
    assert _relative_error(program.run(*inputs), reference) <= 1e-5
    assert program.delegates() == 1


def test_xnnpack_one_batch_norm_1d_on_two_rank_2_tensors_lowers_and_matches_eager():
    torch.manual_seed(0)
    inputs = (torch.randn(2, 4), torch.randn(3, 4))
    program, reference = lower_module_xnnpack(
        OneNormTwice().eval(), inputs, [XnnpackPartitioner()], lower=to_edge_transform_and_lower
    )
    assert _relative_error(program.run(*inputs), reference) <= 1e-5


def test_tosa_fp_norms_sharing_gamma_match_eager():
    model, inputs = _norms_sharing_gamma()
    with arm_folds_registered():
        program, reference = lower_module_tosa(model, inputs, FP)
    assert _relative_error(program.run(*inputs).outputs, reference) <= 1e-5
