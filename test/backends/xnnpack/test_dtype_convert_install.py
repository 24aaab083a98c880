# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The install step behind delegated converts: explicit, idempotent, reversible, loud,
and invisible to stock lowering (byte-identical programs). That importing etfold
installs nothing is `test/test_import_changes_nothing.py`'s fresh interpreter: XNNPACK's
node visitors and its backend's `preprocess` are among what it sees unchanged."""

from __future__ import annotations

import gc
import inspect

import pytest
import torch
from executorch.backends.xnnpack._passes.channels_last_tagged_reshape_pass import (
    ChannelsLastTaggedReshapePass,
)
from executorch.backends.xnnpack.operators import node_visitor
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend
from executorch.exir import EdgeCompileConfig
from executorch.exir import to_edge_transform_and_lower as upstream_lower

from etfold.backends.xnnpack import XnnpackPartitioner, install
from etfold.backends.xnnpack._passes.dtype_convert_match import CONVERT_TARGET
from etfold.backends.xnnpack.operators.op_convert import XNNConvertVisitor
from etfold.demo_models.plain_models import ConvBlock, Mlp
from etfold.exir import to_edge_transform_and_lower as etfold_lower
from etfold.harness.xnnpack_runner import export_method, lower_module_xnnpack, lower_xnnpack


def _upstream_state():
    return (
        inspect.getattr_static(XnnpackBackend, "preprocess"),
        dict(node_visitor._node_visitor_dict),
    )


@pytest.fixture
def pristine():
    """Start uninstalled; leave the process as the test found it."""
    was_installed = install.is_installed()
    install.reset_holds()  # holds a partition-only test left behind, never given back later
    install.uninstall()
    yield _upstream_state()
    install.uninstall()
    if was_installed:
        install.install()


def test_install_is_idempotent_and_uninstall_restores_upstream_exactly(pristine):
    preprocess, visitors = pristine
    install.install()
    install.install()
    assert install.is_installed()
    assert node_visitor._node_visitor_dict[CONVERT_TARGET.__name__] is XNNConvertVisitor
    assert set(node_visitor._node_visitor_dict) == set(visitors) | {CONVERT_TARGET.__name__}
    assert inspect.getattr_static(XnnpackBackend, "preprocess") is not preprocess
    install.uninstall()
    install.uninstall()
    assert not install.is_installed()
    assert inspect.getattr_static(XnnpackBackend, "preprocess") is preprocess
    assert node_visitor._node_visitor_dict == visitors


def test_installed_context_restores_the_previous_state(pristine):
    with install.installed():
        assert install.is_installed()
    assert not install.is_installed()
    install.install()
    with install.installed():
        pass
    assert install.is_installed()


def test_partitioning_with_etfold_installs_before_preprocess(pristine):
    x = torch.randn(2, 3)

    class ToHalf(torch.nn.Module):
        def forward(self, x):
            return x.half()

    program, expected = lower_module_xnnpack(
        ToHalf(), (x,), [XnnpackPartitioner(fold_weights=False)]
    )
    assert program.delegates() == 1 and not program.ops_outside()  # the convert was delegated
    assert torch.equal(program.run(x)[0], expected[0])
    assert not install.is_installed() and install.holds() == 0  # upstream is itself again


def test_holds_taken_by_a_lowering_that_raises_are_given_back(pristine):
    class ToHalf(torch.nn.Module):
        def forward(self, x):
            return x.half()

    program = torch.export.export(ToHalf(), (torch.randn(2, 3),))

    class Failing(XnnpackPartitioner):
        def partition(self, exported_program):
            super().partition(exported_program)
            assert install.is_installed() and install.holds() == 1
            raise RuntimeError("planted")

    with pytest.raises(RuntimeError, match="planted"):
        etfold_lower(program, partitioner=[Failing(fold_weights=False)])
    assert not install.is_installed() and install.holds() == 0
    assert inspect.getattr_static(XnnpackBackend, "preprocess") is pristine[0]


class TwoHalves(torch.nn.Module):
    """Two converts split by a portable op: two marked partitions."""

    def forward(self, x):
        return torch.cumsum(x.half(), 0).float().half()


def _untouched(preprocess) -> bool:
    return (
        not install.is_installed()
        and install.holds() == 0
        and inspect.getattr_static(XnnpackBackend, "preprocess") is preprocess
        and XNNConvertVisitor.target not in node_visitor._node_visitor_dict
    )


def test_upstream_lowering_that_raises_after_partitioning_leaves_upstream_as_it_was(pristine):
    """Through upstream's entry point nothing of etfold's runs after partition(): the
    holds go with the partitioned program, which the failed lowering drops."""
    program = torch.export.export(TwoHalves(), (torch.randn(2, 3),))

    class Failing(XnnpackPartitioner):
        def partition(self, exported_program):
            super().partition(exported_program)
            assert install.is_installed() and install.holds() == 2
            raise RuntimeError("planted")

    with pytest.raises(RuntimeError, match="planted"):
        upstream_lower(program, partitioner=[Failing(fold_weights=False)])
    gc.collect()  # the partitioned graph holds reference cycles
    assert _untouched(pristine[0])


def test_a_preprocess_that_raises_gives_back_every_hold_of_its_lowering(pristine, monkeypatch):
    """The first of two marked partitions fails in preprocess: the lowering is over, the
    second's hold goes too, at once (no collection needed)."""
    program = torch.export.export(TwoHalves(), (torch.randn(2, 3),))

    def planted(self, graph_module):
        assert install.holds() == 2
        raise RuntimeError("planted")

    monkeypatch.setattr(install.RewriteDtypeCopiesAsConvertsPass, "__call__", planted)
    gc.disable()
    try:
        with pytest.raises(RuntimeError, match="planted"):
            upstream_lower(program, partitioner=[XnnpackPartitioner(fold_weights=False)])
        assert _untouched(pristine[0])
    finally:
        gc.enable()


def test_upstream_lowering_gives_back_its_holds_without_a_collection(pristine):
    x = torch.randn(2, 3)
    gc.disable()
    try:
        program, expected = lower_module_xnnpack(
            TwoHalves(), (x,), [XnnpackPartitioner(fold_weights=False)]
        )
        assert _untouched(pristine[0])
    finally:
        gc.enable()
    assert program.delegates() == 2
    assert torch.equal(program.run(x)[0], expected[0])


class Partitioned:
    """Stands in for a partitioned program: only its lifetime matters to a ledger."""


def test_holds_go_with_the_partitioned_program(pristine):
    program = Partitioned()
    install.hold_for(program, 2)
    assert install.is_installed() and install.holds() == 2
    del program
    assert _untouched(pristine[0])


def test_a_ledger_from_before_a_reset_never_gives_back_a_later_hold(pristine):
    stale = Partitioned()
    install.hold_for(stale, 1)
    install.reset_holds()
    assert _untouched(pristine[0])
    with install.installed():
        del stale
        gc.collect()
        assert install.is_installed() and install.holds() == 1
    assert _untouched(pristine[0])


def test_holds_from_concurrent_threads_never_race_the_install(pristine):
    """torch's tracing is process-global, so whole lowerings cannot run in threads
    (stock neither); etfold's own state must still be safe there: many threads
    taking and giving back holds, each checking the install while it holds one."""
    import threading

    seen, barrier = [], threading.Barrier(4)

    def churn():
        barrier.wait()
        for _ in range(200):
            install.acquire()
            seen.append(install.is_installed())
            install.release()

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 800 and all(seen)
    assert not install.is_installed() and install.holds() == 0
    assert inspect.getattr_static(XnnpackBackend, "preprocess") is pristine[0]


@pytest.mark.parametrize(
    "tamper,message",
    [
        (lambda mp: mp.delattr(node_visitor, "_node_visitor_dict"), "_node_visitor_dict is gone"),
        (
            lambda mp: mp.setattr(
                XnnpackBackend, "preprocess", staticmethod(lambda program, specs, extra=None: None)
            ),
            "XnnpackBackend.preprocess takes",
        ),
        (
            lambda mp: mp.setattr(
                XnnpackBackend, "preprocess", classmethod(lambda cls, p, s: None)
            ),
            "no longer a staticmethod",
        ),
        (
            lambda mp: mp.setitem(
                node_visitor._node_visitor_dict, CONVERT_TARGET.__name__, type("Other", (), {})
            ),
            "would replace it",
        ),
        (
            lambda mp: mp.setattr(
                ChannelsLastTaggedReshapePass,
                "memory_sensitive_ops_nchw",
                ChannelsLastTaggedReshapePass.memory_sensitive_ops_nchw | {CONVERT_TARGET},
            ),
            "pins a layout",
        ),
    ],
    ids=[
        "registry_gone",
        "preprocess_signature",
        "preprocess_kind",
        "visitor_taken",
        "layout_pinned",
    ],
)
def test_install_fails_loudly_when_upstream_changes_shape(pristine, monkeypatch, tamper, message):
    tamper(monkeypatch)
    tampered = inspect.getattr_static(XnnpackBackend, "preprocess")
    with pytest.raises(install.UpstreamShapeError, match=message):
        install.install()
    assert inspect.getattr_static(XnnpackBackend, "preprocess") is tampered


class Bf16Block(torch.nn.Module):
    """Converts between bf16 linears and an fp32 softmax: what etfold changes, lowered stock."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x).float().softmax(-1).to(x.dtype)
        return self.b(h)


class ChannelsLastHalf(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(x.float().to(memory_format=torch.channels_last)).half()


def _stock_cases():
    torch.manual_seed(0)
    return {
        "conv_block": (ConvBlock(3, 8).eval(), (torch.randn(1, 3, 16, 16),), {}, None),
        "mlp": (Mlp(32).eval(), (torch.randn(2, 32),), {}, None),
        "bf16_block": (
            Bf16Block().to(torch.bfloat16).eval(),
            (torch.randn(2, 16).to(torch.bfloat16),),
            {"enable_bf16": True},
            None,
        ),
        "channels_last_half": (
            ChannelsLastHalf().eval(),
            (torch.randn(1, 3, 8, 8).half(),),
            {},
            None,
        ),
        "skip_dim_order_bf16": (
            Bf16Block().to(torch.bfloat16).eval(),
            (torch.randn(2, 16).to(torch.bfloat16),),
            {"enable_bf16": True},
            EdgeCompileConfig(_skip_dim_order=True),
        ),
    }


def _stock_bytes(module, inputs, partitioner_kwargs, compile_config) -> bytes:
    program = export_method(module, "forward", inputs)
    lowered = lower_xnnpack(
        program, [UpstreamXnnpackPartitioner(**partitioner_kwargs)], compile_config=compile_config
    )
    return bytes(lowered.executorch.buffer)


# the fp32 MLP, a second model with no convert, in `make test-long` (conv_block has none)
STOCK_CASES = [
    "conv_block",
    pytest.param("mlp", marks=pytest.mark.long),
    "bf16_block",
    "channels_last_half",
    "skip_dim_order_bf16",
]


@pytest.mark.parametrize("name", STOCK_CASES)
def test_stock_lowering_is_byte_identical_with_etfold_installed(pristine, name):
    case = _stock_cases()[name]
    without = _stock_bytes(*case)
    install.install()
    assert _stock_bytes(*case) == without, name
