# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Small helpers for the modules the runners are handed."""

from __future__ import annotations

import torch


def in_eval_mode(module: torch.nn.Module) -> torch.nn.Module:
    """`module.eval()`, except for a module unlifted from an ExportedProgram, which
    refuses `eval()` and already carries the mode it was exported in."""
    try:
        return module.eval()
    except NotImplementedError:
        return module
