# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Attention under each mask users give SDPA, boolean or additive, computed, buffered,
causal or a runtime input, in each shape that broadcasts over batch and heads, is one
XNNPACK delegate, static and dynamic, and matches eager at every checked length.

What may stay outside, and why:
- a dynamic length's mask table, sliced to the length (`sym_size`, two `slice_copy`):
  XNNPACK's slice keeps a dynamic dim whole, it cannot cut one to a runtime length;
- a runtime mask's row test, on the mask's own shape (`ne`, `any`, `where`, a
  bool-to-float copy) and, for a boolean one, its conversion to the float it adds
  (`where`): XNNPACK has no boolean tensors;
- a runtime 4-D mask of dynamic length viewed without its leading 1 (`view_copy`,
  which ExecuTorch runs as an alias of the input): XNNPACK's reshape infers one size.
"""

from __future__ import annotations

import functools

import pytest
import torch

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.harness.dynamic_pairs import dynamic_errors, lower_static_and_dynamic
from etfold.harness.masked_attention import (
    INPUT_MASKS,
    MaskedAttention,
    masked_inputs,
    masked_length,
)
from etfold.harness.xnnpack_runner import assert_close, eager_outputs, lower_xnnpack

TABLE_SLICES = {"aten.sym_size.int", "aten.slice_copy.Tensor"}
RUNTIME_MASK_WORK = {
    "aten.ne.Scalar",
    "aten.any.dim",
    "aten.where.self",
    "dim_order_ops._to_dim_order_copy.default",
}
RUNTIME_MASK_VIEW = {"aten.sym_size.int", "aten.view_copy.default"}
ATOL = {torch.float32: 1e-5, torch.float16: 4e-3}


@functools.cache
def _pair(kind: str, form: str, batch: int, dtype: torch.dtype):
    torch.manual_seed(0)
    module = MaskedAttention(kind, form).to(dtype)
    return lower_static_and_dynamic(
        module,
        masked_inputs(kind, form, batch, dtype),
        masked_length(kind, form),
        lambda: [XnnpackPartitioner()],
    )


def _allowed_outside(kind: str, dynamic: bool) -> set[str]:
    allowed = set(TABLE_SLICES) if dynamic else set()
    if kind in INPUT_MASKS:
        allowed |= RUNTIME_MASK_WORK | (RUNTIME_MASK_VIEW if dynamic else set())
    return allowed


# the short profile: each rewrite these masks need, once (the causal mask, a boolean
# buffer expanded over a batch of two in fp16, a runtime mask's row test); the rest long
ROWS = [
    ("causal", "11TT", 1, torch.float32),
    ("buffer", "B1TT", 2, torch.float16),
    ("input", "11TT", 2, torch.float32),
]
LONG_ROWS = [
    (kind, form, batch, dtype)
    for kind in (
        "tril",
        "additive",
        "finfo_min",
        "additive_buffer",
        "input_additive",
        "causal",
        "buffer",
        "input",
    )
    for form, batch in (("TT", 2), ("1TT", 1), ("11TT", 2), ("B1TT", 2))
    for dtype in (torch.float32, torch.float16)
    if (kind, form, batch, dtype) not in ROWS
    and not (kind == "causal" and form != "11TT")
    and not (kind in INPUT_MASKS and form == "B1TT")  # one mask per sequence: not broadcast
    and (dtype is torch.float32 or form == "11TT")
]


def _row_id(row) -> str:
    kind, form, batch, dtype = row
    return f"{kind}-{form}-b{batch}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.parametrize(
    ("kind", "form", "batch", "dtype"),
    [pytest.param(*row, id=_row_id(row)) for row in ROWS]
    + [pytest.param(*row, id=_row_id(row), marks=pytest.mark.long) for row in LONG_ROWS],
)
def test_attention_is_one_delegate_static_and_dynamic(kind, form, batch, dtype):
    pair = _pair(kind, form, batch, dtype)
    for lowered, dynamic in ((pair.static, False), (pair.dynamic, True)):
        program = lowered.program
        assert program.delegates() == 1
        assert set(program.ops_outside()) <= _allowed_outside(kind, dynamic), program.ops_outside()
    errors = dynamic_errors(pair)
    assert {pair.length.low, pair.length.high} <= set(errors)
    assert max(errors.values()) <= ATOL[dtype], errors


@pytest.mark.parametrize(
    ("kind", "form", "batch", "dtype"),
    [
        pytest.param("input", "11TT", 2, torch.float32, id="input"),
        pytest.param("causal", "11TT", 1, torch.float16, id="causal-fp16", marks=pytest.mark.long),
        pytest.param("buffer", "11TT", 2, torch.float32, id="buffer", marks=pytest.mark.long),
    ],
)
def test_matches_the_unrewritten_program_on_the_runtime(kind, form, batch, dtype):
    """etfold's program against stock ExecuTorch's lowering of the same export (the
    program no rewrite touched), at the traced length: both within the dtype's
    tolerance of eager and of each other."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
        XnnpackPartitioner as StockPartitioner,
    )

    pair = _pair(kind, form, batch, dtype)
    inputs = pair.make_inputs(pair.length.traced)
    exported = torch.export.export(pair.module, inputs)
    stock = lower_xnnpack(exported, [StockPartitioner()])
    ours, theirs = pair.static.program.run(*inputs), stock.run(*inputs)
    expected = eager_outputs(pair.module, inputs)
    assert_close(ours, expected, atol=ATOL[dtype])
    assert_close(theirs, expected, atol=ATOL[dtype])
    assert_close(ours, theirs, atol=ATOL[dtype])
