# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The mutation check: did a lowering write into the user's module or ExportedProgram.

`snapshot(obj)` before, `changes(before, obj)` after: the names of state tensors whose
bytes, dtype or shape differ (or that came or went), and "graph" when the code or the
signature changed. A NaN equals the same NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.export import ExportedProgram


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a NaN equals the same NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_bytes(a), _bytes(b))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@dataclass(frozen=True)
class _Snapshot:
    tensors: dict[str, torch.Tensor]
    code: str


def snapshot(obj: torch.nn.Module | ExportedProgram) -> _Snapshot:
    """Values of every state tensor and the code of the graph (module: its parameters)."""
    if isinstance(obj, ExportedProgram):
        tensors = {**obj.state_dict, **{f"constant:{k}": v for k, v in obj.constants.items()}}
        code = obj.graph_module.code + str(obj.graph_signature)
    else:
        tensors = dict(obj.state_dict(keep_vars=True))
        code = ""
    return _Snapshot(
        {k: v.detach().clone() for k, v in tensors.items() if isinstance(v, torch.Tensor)}, code
    )


def changes(before: _Snapshot, obj: torch.nn.Module | ExportedProgram) -> list[str]:
    """What differs between `before` and `obj` now: the names of changed tensors, or 'graph'."""
    after = snapshot(obj)
    changed = [
        name
        for name in sorted(set(before.tensors) | set(after.tensors))
        if name not in before.tensors
        or name not in after.tensors
        or not _tensors_equal(before.tensors[name], after.tensors[name])
    ]
    return changed + (["graph"] if before.code != after.code else [])
