# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Constant-only work outside GEMM slots: masks, casts of constants, work that decomposition
reveals, implicit promotions of constants, and the checks that stop a fold.

Every lowering runs on the XNNPACK runtime and is compared with eager.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils import parametrize

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack.partition.weight_fold import FOLD
from etfold.backends.xnnpack.partition.weight_fold_promotion import promote_constant_operands
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower as etfold_lower
from etfold.exir.program.lower import MARKING_STEPS
from etfold.harness.demo_lowerings import lowered_demo
from etfold.harness.xnnpack_runner import assert_close, lower_module_xnnpack, max_abs_error

# Shares its decoder lowering with the other readers of `lowered_demo`.

CONVERT = "dim_order_ops._to_dim_order_copy"


def _lower(module, inputs, **kwargs):
    with collect_decisions() as decisions:
        program, reference = lower_module_xnnpack(
            module, inputs, [XnnpackPartitioner(**kwargs)], lower=etfold_lower
        )
    return program, reference, decisions


class MaskedScores(torch.nn.Module):
    """fp32 scores plus a bf16 causal-mask buffer: an implicit widening of a constant."""

    def __init__(self, size: int = 8):
        super().__init__()
        mask = torch.triu(torch.full((size, size), -1e4), 1).to(torch.bfloat16)
        self.register_buffer("mask", mask)
        self.proj = torch.nn.Linear(size, size)

    def forward(self, x):
        return torch.softmax(self.proj(x) + self.mask, dim=-1)


def test_a_constant_widened_by_promotion_folds_to_the_wider_dtype():
    torch.manual_seed(0)
    x = torch.randn(1, 8, 8)
    program, reference, _ = _lower(MaskedScores().eval(), (x,))
    assert not [op for op in program.ops_outside() if op.startswith(CONVERT)]
    assert_close(program.run(x), reference, atol=1e-5)


def test_promotion_rewrites_a_copy_and_leaves_the_program_alone():
    program = torch.export.export(MaskedScores().eval(), (torch.randn(1, 8, 8),))
    for step in MARKING_STEPS:  # what etfold's entry point records before the hook runs
        step({"forward": program})
    code = program.graph_module.code
    promoted = promote_constant_operands(program)
    assert promoted is not program and program.graph_module.code == code
    assert "torch.ops.aten._to_copy.default" in promoted.graph_module.code


class SdpaWithMaskFromLiterals(torch.nn.Module):
    """The bool mask becomes where(mask, 0, -inf) only when sdpa decomposes."""

    def __init__(self, dtype: torch.dtype, size: int = 16):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96).to(dtype)
        self.size = size

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 16)).permute(2, 0, 3, 1, 4)
        mask = torch.ones(self.size, self.size, dtype=torch.bool).tril()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mask_work_revealed_by_decomposition_folds(dtype):
    torch.manual_seed(1)
    x = torch.randn(1, 16, 32).to(dtype)
    module = SdpaWithMaskFromLiterals(dtype).eval()
    program, reference, decisions = _lower(module, (x,), enable_bf16=True)
    outside = program.ops_outside()
    for op in ("aten.scalar_tensor", "aten.bitwise_not", CONVERT):
        assert not [name for name in outside if name.startswith(op)], (op, outside)
    assert max_abs_error(program.run(x), reference) <= (1e-5 if dtype == torch.float32 else 5e-2)
    assert [d for d in decisions if d.fold == FOLD and d.applied and d.where.endswith(".value")]


class SingularInverse(torch.nn.Module):
    def __init__(self, rows: int):
        super().__init__()
        self.register_buffer("mix", torch.eye(rows))

    def forward(self, w):
        return (torch.linalg.inv(self.mix) @ w.flatten(1)).reshape(w.shape)


def test_declines_when_a_runtime_check_reads_the_folded_values():
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    parametrize.register_parametrization(conv, "weight", SingularInverse(4))
    with torch.no_grad():
        conv.parametrizations.weight[0].mix.fill_(1.0)  # singular from now on: inv must fail
    program = torch.export.export(conv.eval(), (torch.randn(1, 3, 5, 5),))
    for step in MARKING_STEPS:
        step({"forward": program})
    with collect_decisions() as decisions:
        hooked = XnnpackPartitioner().transform_for_pre_decomposition(program)
    declined = [d.detail for d in decisions if d.fold == FOLD and not d.applied]
    assert any("checks the folded values at runtime" in reason for reason in declined)
    assert "linalg_inv" in hooked.graph_module.code


def _decoder_counts(fp32_twin: bool) -> tuple[int, int]:
    """The report's Llama row or its fp32 twin (`lowered_demo`, shared with the other files
    that read it): no constant converts outside, outputs close to eager; its counts."""
    pytest.importorskip("transformers")
    lowering = lowered_demo("llama_tiny_bf16", fp32_twin)
    program = lowering.program
    assert not [op for op in program.ops_outside() if op.startswith(CONVERT)]
    outputs = [o.float() for o in program.run(*lowering.inputs)]
    assert max_abs_error(outputs, [r.float() for r in lowering.expected]) <= 2e-2
    return program.delegates(), sum(program.ops_outside().values())


def test_decoder_in_bf16_leaves_no_constant_converts_outside():
    _decoder_counts(fp32_twin=False)


# another decoder lowering: `make test` checks the bf16 row's absolute counts instead
# (two delegates, in test_safe_softmax_as_softmax_pass)
@pytest.mark.long
def test_decoder_in_bf16_lowers_as_completely_as_its_fp32_twin():
    bf16, fp32 = _decoder_counts(fp32_twin=False), _decoder_counts(fp32_twin=True)
    assert bf16[0] <= fp32[0] and bf16[1] <= fp32[1]
