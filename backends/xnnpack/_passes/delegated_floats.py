# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The float dtypes XNNPACK takes for a rewritten op in one lowering, and the decline otherwise.

float32 and float16 always; bfloat16 only where the lowering enables it for that
op (the caller asks `bf16_setting`), since XNNPACK 1.5.1 compiles few ops in bf16.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from etfold.decisions import Declined

FULL_AND_HALF = frozenset({torch.float32, torch.float16})


def delegated_floats(bf16: bool) -> frozenset[torch.dtype]:
    return FULL_AND_HALF | {torch.bfloat16} if bf16 else FULL_AND_HALF


def dtype_taken(value: torch.Tensor, dtypes: Collection[torch.dtype], work: str) -> Declined | None:
    """None when XNNPACK takes `value`'s dtype for `work` here; else why the op stays outside."""
    if value.dtype in dtypes:
        return None
    names = "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    return Declined(f"{value.dtype} {work}: XNNPACK takes {names} for it here")
