# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""What keeps the suite independent of the machine, earlier runs and test order.

- Generated (hypothesis) cases are derandomized and keep no example database, so
  a run never replays what an earlier run found and every machine draws the same
  cases. `HYPOTHESIS_PROFILE=explore` draws fresh cases (with no database either)
  for a developer hunting new ones; the long fuzz profile is `make fuzz`.
- `ETFOLD_TEST_SHUFFLE=SEED` runs the collected tests in an order shuffled by
  SEED, the check that no test leans on another having run first (CONTRIBUTING).
- Every test runs inside `torch_speedups()`, as etfold's entry point does: torch
  lowers exactly as it would, without repeating one lookup per op namespace and
  without deep-copying every node's provenance chain on every pass (a fifth of
  each small lowering and a third of a decoder's, stock and etfold alike).
"""

import os
import random

import pytest
from hypothesis import settings

from etfold.exir.program.lower import torch_speedups

settings.register_profile("suite", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", database=None, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


def pytest_collection_modifyitems(config, items):
    seed = os.environ.get("ETFOLD_TEST_SHUFFLE")
    if seed:
        random.Random(seed).shuffle(items)


@pytest.fixture(autouse=True, scope="session")
def _torch_speedups():
    with torch_speedups():
        yield
