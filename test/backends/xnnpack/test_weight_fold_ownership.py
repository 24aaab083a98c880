# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Constants the fold creates: one name and one tensor when folded twice, and owned by
the delegate that reads them (never a runtime input of it), or a recorded reason.

The LSTM folds its first step (`h0 @ W_hh.T + b_hh` with h0 = 0, read by an add) and
its zero cell state (folded before and again after decomposition, read by a mul).
"""

from __future__ import annotations

import re

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from executorch.exir import to_edge_transform_and_lower as upstream_lower
from torch.export.graph_signature import InputKind

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack.partition.weight_fold_ownership import (
    FOLD,
    folded_constants,
    owning_tag,
)
from etfold.decisions import Declined, collect_decisions
from etfold.exir import to_edge_transform_and_lower as etfold_lower
from etfold.exir.passes.constant_prop.name import fold_root, is_folded_target
from etfold.harness.xnnpack_runner import assert_close, lower_module_xnnpack

DIGEST = "0123456789abcdef" * 4
# the LSTM's sequence: a first step (folded) and steps after it (the graph grows per step)
STEPS = 3
_DELEGATE_CALL = torch.ops.higher_order.executorch_call_delegate


class LstmHead(torch.nn.Module):
    def __init__(self, size: int = 8):
        super().__init__()
        self.lstm = torch.nn.LSTM(size, size, batch_first=True)
        self.head = torch.nn.Linear(size, 4)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1, :])


def _delegate_state_inputs(edge) -> list[str]:
    """State placeholders (parameters, buffers, constants) passed into a delegate call."""
    ep = edge.exported_program()
    state = {
        s.arg.name
        for s in ep.graph_signature.input_specs
        if s.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    }
    calls = ep.graph.find_nodes(op="call_function", target=_DELEGATE_CALL)
    return [a.name for call in calls for a in call.args[1:] if getattr(a, "name", None) in state]


def test_fold_names_keep_one_suffix():
    assert fold_root(f"lstm.weight_hh_l0_prop_{DIGEST}") == "lstm.weight_hh_l0"
    assert fold_root(f"_prop_{DIGEST}") == ""
    assert fold_root("lstm.weight_hh_l0") == "lstm.weight_hh_l0"
    assert is_folded_target(f"w_prop_{DIGEST}") and is_folded_target("_prop_tensor_constant3")
    assert not is_folded_target("w_prop_1234") and not is_folded_target("lstm.weight_hh_l0")


def test_a_constant_folded_twice_has_one_name_and_one_tensor():
    torch.manual_seed(0)
    program = torch.export.export(LstmHead().eval(), (torch.randn(1, STEPS, 8),))
    folded = XnnpackPartitioner().transform_for_pre_decomposition(program)
    targets = [s.target for s in folded.graph_signature.input_specs if s.target]
    made = [t for t in targets if is_folded_target(t)]
    assert made, targets
    assert not [t for t in made if len(re.findall(r"_prop_", t)) > 1]
    stored = set(folded.state_dict) | set(folded.constants)
    assert stored == set(t for t in targets if t in stored)  # no tensor left behind


def test_folded_lstm_constants_are_owned_by_their_delegate():
    torch.manual_seed(0)
    x = torch.randn(1, STEPS, 8)
    with collect_decisions() as decisions:
        program, reference = lower_module_xnnpack(
            LstmHead().eval(), (x,), [XnnpackPartitioner()], lower=etfold_lower
        )
    owned = [d for d in decisions if d.fold == FOLD]
    assert owned and all(d.applied for d in owned), owned
    assert _delegate_state_inputs(program.edge) == []
    assert_close(program.run(x), reference, atol=1e-5)


def test_upstreams_partitioner_leaves_the_folded_constants_as_delegate_inputs():
    """The counterpart: upstream's configs claim GEMM operands only, so the constants etfold's
    fold made are runtime inputs unless etfold's partitioner owns them."""
    torch.manual_seed(0)
    program = torch.export.export(LstmHead().eval(), (torch.randn(1, STEPS, 8),))
    folded = XnnpackPartitioner().transform_for_pre_decomposition(program)
    edge = upstream_lower(folded, partitioner=[UpstreamXnnpackPartitioner()])
    assert _delegate_state_inputs(edge)


def _readers(*tags):
    graph = torch.fx.Graph()
    constant = graph.placeholder("c")
    for i, tag in enumerate(tags):
        reader = graph.call_function(torch.neg, (constant,), name=f"r{i}")
        if tag is not None:
            reader.meta["delegation_tag"] = tag
    return constant


def test_owning_tag_is_the_readers_one_partition():
    assert owning_tag(_readers("tag0", "tag0")) == "tag0"


def test_declines_when_read_by_two_delegates():
    verdict = owning_tag(_readers("tag0", "tag1"))
    assert isinstance(verdict, Declined) and "read by 2 delegates (tag0, tag1)" in verdict.reason


def test_declines_when_also_read_outside_every_delegate():
    verdict = owning_tag(_readers("tag0", None))
    assert isinstance(verdict, Declined) and "outside every delegate (by r1)" in verdict.reason


def test_nothing_to_own_when_no_reader_is_delegated_or_already_owned():
    assert owning_tag(_readers(None, None)) is None
    constant = _readers("tag0")
    constant.meta["delegation_tag"] = "tag0"
    assert owning_tag(constant) is None


def test_folded_constants_are_found_by_their_signature_target():
    torch.manual_seed(0)
    program = torch.export.export(LstmHead().eval(), (torch.randn(1, STEPS, 8),))
    assert folded_constants(program) == []
    folded = XnnpackPartitioner().transform_for_pre_decomposition(program)
    names = [n.name for n in folded_constants(folded)]
    assert names and all("_prop_" in n for n in names)
