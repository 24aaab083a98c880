# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""What XNNPACK takes for a rewritten op in one lowering, and the decline otherwise.

Float dtypes: float32 and float16 always; bfloat16 only where the lowering
enables it for that op (the caller asks `bf16_setting`), since XNNPACK 1.5.1
compiles few ops in bf16. Ranks up to XNN_MAX_TENSOR_DIMS. Float inputs only: a
dequantized input would need the rewritten ops quantized too.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from executorch.backends.xnnpack.utils.quant_utils import is_dequant

from etfold.decisions import Declined

XNN_MAX_TENSOR_DIMS = 6
FULL_AND_HALF = frozenset({torch.float32, torch.float16})


def delegated_floats(bf16: bool) -> frozenset[torch.dtype]:
    return FULL_AND_HALF | {torch.bfloat16} if bf16 else FULL_AND_HALF


def dtype_taken(value: torch.Tensor, dtypes: Collection[torch.dtype], work: str) -> Declined | None:
    """None when XNNPACK takes `value`'s dtype for `work` here; else why the op stays outside."""
    if value.dtype in dtypes:
        return None
    names = "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    return Declined(f"{value.dtype} {work}: XNNPACK takes {names} for it here")


def exact_in(number: float, dtype: torch.dtype) -> bool:
    """`number` is a value of `dtype`: converting it to `dtype` does not round it."""
    return float(torch.tensor(number, dtype=torch.float64).to(dtype)) == number


def rank_held(rank: int, what: str) -> Declined | None:
    """None when XNNPACK holds a tensor of `rank` dims; else why (`what`: "input", …)."""
    if rank > XNN_MAX_TENSOR_DIMS:
        return Declined(f"rank {rank} {what}: XNNPACK holds at most {XNN_MAX_TENSOR_DIMS} dims")
    return None


def not_quantized(source: torch.fx.Node, consequence: str) -> Declined | None:
    """None unless `source` is a dequantize; `consequence` says what quantization would need."""
    if is_dequant(source):
        return Declined(f"quantized input: {consequence}")
    return None
