# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""One fuzz test imports another by name (the planted-bug test runs the short profile)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
