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
  left every test to be scheduled alone. Files go out longest first, by their
  seconds in the last recorded run (test/file_seconds.json; a new file by its
  source size), so the last ones sent are short. A file whose tests share no
  costly lowering may be split into one unit per test (FILES_SCHEDULED_BY_TEST).
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
- The tests lower as users do and compare with unpatched stock: etfold's
  lowerings run with the lowering speed-ups (`torch_speedups`, which etfold's
  entry point enters by default), every stock lowering the harness runs beside
  them runs without (`ETFOLD_SPEEDUPS=etfold`, subprocesses included; the
  harness names a lowering stock when it is upstream's entry point with
  upstream's partitioners and no etfold fold registered). Export, quantization
  and calibration run on stock torch either way.
  test/exir/program/test_speedups_bytes.py and
  test/etfold/test_speedups_on_what_users_lower.py (every program the report,
  the benchmarks and the LLM export lower, a rotating sample in `make test`) turn
  them on and off explicitly and compare the bytes.
- `make test` ends with where the time went: the files that took longest
  (setup, call and teardown of their tests, summed) and how long each worker
  was busy against the wall clock, so the idle tail shows, and the cases a
  rotating sample picked for this run. `ETFOLD_RECORD_FILE_SECONDS=1` writes
  the files' seconds to test/file_seconds.json, the order of the next runs.
- Torch builds each structured-trace event (graphs printed, stacks summarized)
  only while its trace logger has a handler of its own; outside pytest it has
  none after its first event. pytest's log capture attaches a handler to every
  logger that does not propagate, so torch built those payloads for nobody (2 %
  of the suite): during the tests the trace logger propagates instead.
"""

import gc
import json
import logging
import os
import random
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import settings
from xdist.scheduler import LoadScopeScheduling

os.environ["ETFOLD_SPEEDUPS"] = "etfold"  # before anything lowers: see the module doc

settings.register_profile("suite", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", database=None, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


SHARED_DEMO_LOWERINGS = "demo_lowerings"
# files whose tests share nothing costly: each test is a unit of its own, so both workers
# take some (the speed-ups' byte comparisons, tens of seconds each in the long profile)
FILES_SCHEDULED_BY_TEST = frozenset({"test/etfold/test_speedups_on_what_users_lower.py"})
# each file's seconds in the last recorded `make test` (ETFOLD_RECORD_FILE_SECONDS=1)
FILE_SECONDS = Path(__file__).parent / "file_seconds.json"
RECORD_FILE_SECONDS = "ETFOLD_RECORD_FILE_SECONDS"


def _files_reading_demo_lowerings(root: Path) -> frozenset[str]:
    tests = Path(__file__).parent
    return frozenset(
        path.relative_to(root).as_posix()
        for path in tests.rglob("test_*.py")
        if "lowered_demo(" in path.read_text(encoding="utf-8")
    )


def _recorded_file_seconds() -> dict[str, float]:
    try:
        return json.loads(FILE_SECONDS.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


class FileScheduling(LoadScopeScheduling):
    """A test file is one unit of work; the files reading `lowered_demo` are one unit.

    Units go out longest first: a worker is sent its next unit before it
    finishes the current one, so a long unit sent last leaves the other worker
    idle. A unit's expected time is its tests' share of their files' seconds
    in the last recorded run (test/file_seconds.json); a file not recorded yet
    is guessed from its source size at the recorded files' median seconds per
    byte, and goes out before recorded files of the same guess. A shuffled run
    (`ETFOLD_TEST_SHUFFLE`) keeps its shuffled order of files.
    """

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self.root = config.rootpath
        self.shared = _files_reading_demo_lowerings(self.root)
        self.recorded = _recorded_file_seconds()
        shuffled = bool(os.environ.get("ETFOLD_TEST_SHUFFLE"))
        self.queue_ordered = shuffled
        if shuffled:
            config.option.loadscopereorder = False  # xdist's own sort by test count

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        if path in FILES_SCHEDULED_BY_TEST:
            return nodeid
        return SHARED_DEMO_LOWERINGS if path in self.shared else path

    def _source_bytes(self, path: str) -> int:
        file = self.root / path
        return file.stat().st_size if file.is_file() else 0

    def _expected_seconds(self) -> dict[str, float]:
        """Expected seconds of each file's tests, from the record or the source size."""
        paths = {nodeid.split("::", 1)[0] for unit in self.workqueue.values() for nodeid in unit}
        rates = sorted(
            self.recorded[p] / self._source_bytes(p)
            for p in paths
            if p in self.recorded and self._source_bytes(p)
        )
        rate = rates[len(rates) // 2] if rates else 1.0
        return {p: self.recorded.get(p, self._source_bytes(p) * rate) for p in paths}

    def _order_work_queue(self) -> None:
        seconds = self._expected_seconds()
        tests = Counter(nodeid.split("::", 1)[0] for u in self.workqueue.values() for nodeid in u)

        def expected(unit) -> tuple[float, bool]:
            paths = [nodeid.split("::", 1)[0] for nodeid in unit]
            share = sum(seconds[p] / tests[p] for p in paths)
            return share, not all(p in self.recorded for p in paths)

        units = sorted(self.workqueue.items(), key=lambda u: expected(u[1]), reverse=True)
        self.workqueue.clear()
        self.workqueue.update(units)

    def _assign_work_unit(self, node) -> None:
        if not self.queue_ordered:
            self._order_work_queue()
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


FILES_SHOWN = 15
# the user property with which a test names the case a rotating sample picked for this run
ROTATING_SAMPLE = "rotating sample"


class FileTimes:
    """Seconds per test file and per worker, summed from the reports of every test phase.

    Under xdist the workers' reports reach the controlling process, which prints.
    """

    def __init__(self):
        self.started = time.perf_counter()
        self.by_file: Counter[str] = Counter()
        self.tests: Counter[str] = Counter()
        self.by_worker: Counter[str] = Counter()
        self.sampled: list[str] = []

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::", 1)[0]
        self.by_file[path] += report.duration
        self.tests[path] += report.when == "call"
        node = getattr(report, "node", None)  # the xdist worker that ran it
        if node is not None:
            self.by_worker[node.gateway.id] += report.duration
        if report.when == "call":
            self.sampled += [v for k, v in report.user_properties if k == ROTATING_SAMPLE]

    def pytest_terminal_summary(self, terminalreporter):
        for case in sorted(self.sampled):
            terminalreporter.write_line(f"{ROTATING_SAMPLE}: {case}")
        if len(self.by_file) < 2:
            return
        wall = time.perf_counter() - self.started
        total = sum(self.by_file.values())
        write = terminalreporter.write_line
        terminalreporter.section("test time by file (setup + call + teardown)")
        top = self.by_file.most_common(FILES_SHOWN)
        for path, seconds in top:
            write(f"{seconds:8.1f} s {self.tests[path]:5d} tests  {path}")
        shown = sum(seconds for _, seconds in top)
        write(
            f"the {len(top)} longest of {len(self.by_file)} files: {shown:.0f} s of the "
            f"tests' {total:.0f} s"
        )
        busy = ", ".join(f"{w} {s:.0f} s" for w, s in sorted(self.by_worker.items()))
        write(f"wall {wall:.0f} s" + (f"; workers busy: {busy}" if busy else ""))
        if os.environ.get(RECORD_FILE_SECONDS):
            self.record(terminalreporter.config.rootpath)
            write(f"recorded in {FILE_SECONDS.relative_to(terminalreporter.config.rootpath)}")

    def record(self, root: Path) -> None:
        """This run's seconds for the files it ran; earlier ones for files that still exist."""
        recorded = {p: s for p, s in _recorded_file_seconds().items() if (root / p).is_file()}
        recorded.update((p, round(s, 1)) for p, s in self.by_file.items())
        FILE_SECONDS.write_text(json.dumps(dict(sorted(recorded.items())), indent=0) + "\n")


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the process that prints
        config.pluginmanager.register(FileTimes(), "etfold_test_times")
