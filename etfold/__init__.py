# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""etfold: guarded, registered folds for ExecuTorch's XNNPACK and Arm backends.

Importing `etfold` is cheap (no torch): the folds live in `etfold.backends` and
`etfold.exir`. `etfold.set_log_level("INFO")` shows every fold decision;
`etfold.collect_decisions()` gathers them in a block.

etfold supports executorch 1.5.1 with torch 2.13; on any other release the
import warns (`etfold.versions`). Every lowering entry point lives under
`etfold`, so the check runs before any of them.
"""

from etfold.decisions import collect_decisions, set_log_level
from etfold.versions import warn_if_unsupported

__version__ = "0.1.0"

__all__ = ["__version__", "collect_decisions", "set_log_level"]

warn_if_unsupported()
