# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""etfold's XNNPACK partitioner tells which workflow called it as upstream's does:
with upstream's own check, inherited; etfold reads no frame for it.

Stacks of frames with chosen function and file names are built from code compiled
under those names; at the innermost frame upstream's own check (`inspect.stack()`)
and etfold's partitioner must agree. The real workflows are checked end to end.
"""

import functools
import logging

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from executorch.exir import to_edge
from hypothesis import given, settings
from hypothesis import strategies as st

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.exir import to_edge_transform_and_lower

CHECK = "_check_if_called_from_to_backend"

NAMES = ("to_backend", "to_edge_transform_and_lower", "partition", "lower")
FILES = ("executorch/exir/program/_program.py", "etfold/exir/program/lower.py", "model.py")


def upstreams_check():
    """Upstream's check, unbound (it reads only the stack, never its partitioner)."""
    return vars(UpstreamXnnpackPartitioner)[CHECK]


def test_etfold_inherits_upstreams_check_and_reads_no_frame_of_its_own():
    assert CHECK not in vars(XnnpackPartitioner)
    assert getattr(XnnpackPartitioner, CHECK) is upstreams_check()


@functools.cache
def _partitioner() -> XnnpackPartitioner:
    return XnnpackPartitioner()  # the check reads no state of its partitioner


def _verdicts_at_the_bottom_of(frames: list[tuple[str, str]]) -> tuple[bool, bool]:
    """Call through one function per (name, file), outermost first; both verdicts innermost."""
    partitioner = _partitioner()

    def innermost():
        return upstreams_check()(partitioner), partitioner._check_if_called_from_to_backend()

    call = innermost
    for name, file in reversed(frames):
        scope = {"inner": call}
        exec(compile(f"def {name}():\n    return inner()\n", file, "exec"), scope)
        call = scope[name]
    return call()


def test_the_deprecated_workflow_is_told_only_from_executorchs_to_backend():
    program_module = FILES[0]
    assert _verdicts_at_the_bottom_of([("to_backend", program_module)]) == (True, True)
    assert _verdicts_at_the_bottom_of([("to_backend", "model.py")]) == (False, False)
    both = [("to_edge_transform_and_lower", "model.py"), ("to_backend", program_module)]
    assert _verdicts_at_the_bottom_of(both) == (False, False)
    assert _verdicts_at_the_bottom_of([]) == (False, False)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(FILES)), max_size=5))
def test_generated_stacks_get_upstreams_verdict(frames):
    upstream, ours = _verdicts_at_the_bottom_of(frames)
    assert ours == upstream


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.linear(x)


def test_both_workflows_warn_as_upstream_does(caplog):
    program = torch.export.export(_Linear().eval(), (torch.randn(1, 4),))
    with caplog.at_level(logging.WARNING):
        to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
        assert "DEPRECATION WARNING" not in caplog.text
        to_edge(program).to_backend(XnnpackPartitioner())
    assert "DEPRECATION WARNING" in caplog.text
