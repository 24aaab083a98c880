# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

import io
import logging
import threading

import etfold
from etfold.decisions import Declined, collect_decisions, record_applied, record_declined


def test_collectors_see_only_what_happens_inside_them(caplog):
    record_declined("fold.a", "n0", "before any collector")
    with caplog.at_level(logging.INFO, logger="etfold"), collect_decisions() as outer:
        record_applied("fold.a", "n1", "scaled by 2")
        with collect_decisions() as inner:
            record_declined("fold.b", "n2", "scale is not finite")
    assert [(d.fold, d.applied, d.where) for d in outer] == [
        ("fold.a", True, "n1"),
        ("fold.b", False, "n2"),
    ]
    assert [d.detail for d in inner] == ["scale is not finite"]
    assert "fold.b declined at n2: scale is not finite" in caplog.text


def test_equal_empty_collectors_are_removed_by_identity():
    with collect_decisions() as first:
        with collect_decisions():
            pass
        record_applied("fold.a", "n", "")
    assert len(first) == 1


def test_declined_is_falsy_and_carries_its_reason():
    declined = Declined("conv output has several users")
    assert not declined
    assert declined.reason == "conv output has several users"


def test_each_fold_logs_on_its_own_logger(caplog):
    with caplog.at_level(logging.INFO, logger="etfold"):
        record_applied("xnnpack.fold_gemm_weight", "conv", "weight folded")
        record_declined("arm.scalar_mul_into_conv", "mul", "carried state")
    assert [(r.name, r.levelno) for r in caplog.records] == [
        ("etfold.xnnpack.fold_gemm_weight", logging.INFO),
        ("etfold.arm.scalar_mul_into_conv", logging.INFO),
    ]


def test_set_log_level_shows_decisions_despite_a_configured_root_logger():
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    probe_root = io.StringIO()
    stream = io.StringIO()
    try:
        root.handlers[:] = [logging.StreamHandler(probe_root)]
        root.setLevel(logging.WARNING)  # what ExecuTorch's import-time basicConfig leaves
        logging.basicConfig(level=logging.INFO)  # a user's attempt: a no-op now
        record_applied("fold.hidden", "n0", "not shown")
        etfold.set_log_level("INFO", stream=stream)
        etfold.set_log_level("INFO", stream=stream)  # idempotent: one handler
        record_declined("fold.shown", "n1", "shape is dynamic")
    finally:
        etfold.set_log_level(None)
        root.handlers[:] = saved[1]
        root.setLevel(saved[0])
    assert stream.getvalue() == "etfold.fold.shown: fold.shown declined at n1: shape is dynamic\n"
    assert probe_root.getvalue() == ""  # neither before (level) nor after (no duplicate)
    assert logging.getLogger("etfold").propagate


def test_collectors_are_context_local_across_threads():
    barrier = threading.Barrier(2)
    seen: dict[str, list[str]] = {}

    def work(name: str) -> None:
        with collect_decisions() as mine:
            barrier.wait()  # both blocks are open before either records
            for i in range(50):
                record_applied(f"fold.{name}", f"n{i}", "")
            barrier.wait()  # both have recorded before either block closes
        seen[name] = sorted({d.fold for d in mine})

    with collect_decisions() as main_thread:
        threads = [threading.Thread(target=work, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert seen == {"a": ["fold.a"], "b": ["fold.b"]}
    assert main_thread == []
