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
- Under `make test` (`-n 2 --dist loadgroup`) a file's tests run on one worker,
  so the lowerings a file caches serve all its tests, and the files that read
  `lowered_demo` run on one worker together (`FileScheduling`). The grouping is
  decided here, from paths, in the process that schedules: pytest 9 ignores the
  node-id suffix through which xdist 3.8 passes `xdist_group` marks, which
  left every test to be scheduled alone. Files go out largest source first, so
  the last ones sent are short.
- Each test file starts with everything alive so far frozen out of the cyclic
  garbage collector (`gc.freeze()`, after a full collection): the half a
  million objects torch and executorch create at import, and the lowerings
  caches keep, are never garbage, and rescanning them at each full collection
  was a quarter of a small lowering. Garbage created during a file is
  collected as usual, at thresholds raised for lowering's allocation pattern.
- Each worker computes on one thread (torch's intra-op pool and the ExecuTorch
  runtime's threadpool): `make test` runs one worker per core, and two pools
  of two threads each on two cores spend their time waiting for each other
  (7-8 % of the suite's time), on models too small to gain from a second thread.
- The tests run on stock torch: the lowering speed-ups (`torch_speedups`, which
  etfold's entry point enters by default) are switched off for the whole run
  (`ETFOLD_SPEEDUPS=0`, subprocesses included), so every fold is proven, and
  every "stock" lowering is, unpatched. test/exir/program/test_speedups_bytes.py
  turns them on explicitly and compares the bytes with the same lowerings off.
- Torch builds each structured-trace event (graphs printed, stacks summarized)
  only while its trace logger has a handler of its own; outside pytest it has
  none after its first event. pytest's log capture attaches a handler to every
  logger that does not propagate, so torch built those payloads for nobody (2 %
  of the suite): during the tests the trace logger propagates instead.
"""

import gc
import logging
import os
import random
from pathlib import Path

import pytest
from hypothesis import settings
from xdist.scheduler import LoadScopeScheduling

os.environ["ETFOLD_SPEEDUPS"] = "0"  # before anything lowers: see the module doc

settings.register_profile("suite", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", database=None, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


SHARED_DEMO_LOWERINGS = "demo_lowerings"


def _files_reading_demo_lowerings(root: Path) -> frozenset[str]:
    tests = Path(__file__).parent
    return frozenset(
        path.relative_to(root).as_posix()
        for path in tests.rglob("test_*.py")
        if "lowered_demo(" in path.read_text(encoding="utf-8")
    )


class FileScheduling(LoadScopeScheduling):
    """A test file is one unit of work; the files reading `lowered_demo` are one unit.

    Units go out largest source first: a worker is sent its next unit before it
    finishes the current one, so a long unit sent last leaves the other worker
    idle. Source size is the best free guess at a file's time (it tracks test
    time better than the number of tests, xdist's own order). A shuffled run
    (`ETFOLD_TEST_SHUFFLE`) keeps its shuffled order of files.
    """

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self.root = config.rootpath
        self.shared = _files_reading_demo_lowerings(self.root)
        shuffled = bool(os.environ.get("ETFOLD_TEST_SHUFFLE"))
        self.queue_ordered = shuffled
        if shuffled:
            config.option.loadscopereorder = False  # xdist's own sort by test count

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return SHARED_DEMO_LOWERINGS if path in self.shared else path

    def _source_bytes(self, work_unit) -> int:
        paths = {nodeid.split("::", 1)[0] for nodeid in work_unit}
        files = (self.root / path for path in paths)
        return sum(file.stat().st_size for file in files if file.is_file())

    def _assign_work_unit(self, node) -> None:
        if not self.queue_ordered:
            units = sorted(self.workqueue.items(), key=lambda u: -self._source_bytes(u[1]))
            self.workqueue.clear()
            self.workqueue.update(units)
            self.queue_ordered = True
        super()._assign_work_unit(node)


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: absent under `-p no:xdist`
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        return FileScheduling(config, log)
    return None


_TORCH_TRACE_LOGGER = "torch.__trace"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtestloop(session):
    """Tests run with torch's trace logger propagating: pytest's capture attaches only to
    loggers that do not propagate, so it stays without a handler, as outside pytest."""
    trace = logging.getLogger(_TORCH_TRACE_LOGGER)
    saved = trace.propagate
    trace.propagate = True
    try:
        return (yield)
    finally:
        trace.propagate = saved


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    seed = os.environ.get("ETFOLD_TEST_SHUFFLE")
    if seed:
        random.Random(seed).shuffle(items)


@pytest.fixture(autouse=True, scope="session")
def _one_thread_per_worker():
    import torch
    from executorch.extension.pybindings import portable_lib

    saved = torch.get_num_threads(), portable_lib._threadpool_get_thread_count()
    torch.set_num_threads(1)
    portable_lib._unsafe_reset_threadpool(1)
    yield
    torch.set_num_threads(saved[0])
    portable_lib._unsafe_reset_threadpool(saved[1])


# Young objects collected every 100,000 allocations rather than 700, and a full
# collection after 1,000 middle ones rather than 10: a lowering allocates millions of
# short-lived objects, few in cycles, and the default thresholds cost a tenth to a
# fifth of a test's time. Each file still starts from a full collection.
_GC_THRESHOLDS = (100_000, 50, 1_000)


@pytest.fixture(autouse=True, scope="session")
def _fewer_gc_passes():
    saved = gc.get_threshold()
    gc.set_threshold(*_GC_THRESHOLDS)
    yield
    gc.set_threshold(*saved)


@pytest.fixture(autouse=True, scope="module")
def _survivors_frozen_out_of_gc(_fewer_gc_passes):
    gc.collect()
    gc.freeze()
    yield
