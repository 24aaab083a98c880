# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Two methods must not write different tensors under one external constant name: etfold's
lowering renames such constants apart, and the check finds them in any program."""

from __future__ import annotations

import pytest
import torch
from executorch.exir import ExecutorchBackendConfig
from executorch.exir import to_edge_transform_and_lower as upstream_to_edge_transform_and_lower

from etfold.exir import (
    ExternalConstantCollisionError,
    constant_prop_pass,
    to_edge_transform_and_lower,
)
from etfold.exir.emit import check_external_constant_names
from etfold.harness.external_data import data_files, data_keys, load_with_data
from etfold.harness.xnnpack_runner import assert_close, eager_outputs, export_method, max_abs_error

torch.manual_seed(0)
EXTERNAL = ExecutorchBackendConfig(external_constants=True)


class TwoScales(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return x @ (self.w * 2).t()

    def other(self, x):
        return x @ (self.w * 3).t()


def upstream_named_folds(model, x):
    """Each method folded the upstream way: both get `_prop_tensor_constant0`."""
    return {m: constant_prop_pass(export_method(model, m, (x,))) for m in ("forward", "other")}


def _programs_of(executorch):
    return {m: executorch.exported_program(m) for m in executorch.methods}


def test_the_check_names_the_constant_the_methods_and_the_cause():
    model, x = TwoScales().eval(), torch.randn(2, 8)
    edge = upstream_to_edge_transform_and_lower(upstream_named_folds(model, x))
    with pytest.raises(ExternalConstantCollisionError) as error:
        check_external_constant_names(_programs_of(edge.to_executorch(EXTERNAL)))
    message = str(error.value)
    assert "'_prop_tensor_constant0'" in message
    assert "forward" in message and "other" in message and "the data differ" in message


def test_etfolds_lowering_gives_each_method_its_own_external_entry():
    model, x = TwoScales().eval(), torch.randn(2, 8)
    edge = to_edge_transform_and_lower(upstream_named_folds(model, x))
    executorch = edge.to_executorch(EXTERNAL)
    check_external_constant_names(_programs_of(executorch))
    keys = set().union(*(data_keys(blob) for blob in data_files(executorch).values()))
    assert {"_prop_tensor_constant0", "_prop_tensor_constant0.other"} <= keys
    runtime = load_with_data(executorch.buffer, data_files(executorch))
    for method in ("forward", "other"):
        assert_close(
            list(runtime.run_method(method, (x,))), eager_outputs(model, (x,), method), atol=1e-5
        )


def test_the_users_programs_keep_their_names():
    model, x = TwoScales().eval(), torch.randn(2, 8)
    progs = upstream_named_folds(model, x)
    before = {m: str(p.graph_signature) for m, p in progs.items()}
    to_edge_transform_and_lower(progs)
    assert {m: str(p.graph_signature) for m, p in progs.items()} == before


def test_the_collision_is_real_on_upstreams_path():
    """What the check prevents: upstream emits it, and one method reads the other's weight."""
    model, x = TwoScales().eval(), torch.randn(2, 8)
    edge = upstream_to_edge_transform_and_lower(upstream_named_folds(model, x))
    executorch = edge.to_executorch(EXTERNAL)
    runtime = load_with_data(executorch.buffer, data_files(executorch))
    errors = [
        max_abs_error(list(runtime.run_method(m, (x,))), eager_outputs(model, (x,), m))
        for m in ("forward", "other")
    ]
    assert max(errors) > 0.1


def test_same_data_under_one_name_is_allowed():
    model, x = TwoScales().eval(), torch.randn(2, 8)
    progs = {
        m: export_method(model, m, (x,)) for m in ("forward", "other")
    }  # both read parameter w
    executorch = to_edge_transform_and_lower(progs).to_executorch(EXTERNAL)
    runtime = load_with_data(executorch.buffer, data_files(executorch))
    for method in progs:
        assert_close(
            list(runtime.run_method(method, (x,))), eager_outputs(model, (x,), method), atol=1e-5
        )


def test_names_only_matter_for_external_constants():
    model, x = TwoScales().eval(), torch.randn(2, 8)
    executorch = to_edge_transform_and_lower(upstream_named_folds(model, x)).to_executorch()
    runtime = load_with_data(executorch.buffer, {})
    for method in ("forward", "other"):
        assert_close(
            list(runtime.run_method(method, (x,))), eager_outputs(model, (x,), method), atol=1e-5
        )


def test_register_like_source_names_pass_the_check():
    model, x = TwoScales().eval(), torch.randn(2, 8)
    progs = {
        m: constant_prop_pass(export_method(model, m, (x,)), register_like_source=True)
        for m in ("forward", "other")
    }
    executorch = to_edge_transform_and_lower(progs).to_executorch(EXTERNAL)
    runtime = load_with_data(executorch.buffer, data_files(executorch))
    for method in progs:
        assert_close(
            list(runtime.run_method(method, (x,))), eager_outputs(model, (x,), method), atol=1e-5
        )


class Counter(torch.nn.Module):
    def __init__(self, start: float):
        super().__init__()
        self.register_buffer("count", torch.full((2,), start))
        self.w = torch.nn.Parameter(torch.full((2,), start))

    def forward(self, x):
        self.count.add_(1)
        return x * self.w + self.count


def test_renaming_gives_each_data_one_name_and_leaves_written_state_alone():
    from etfold.exir.emit.external_constants import give_distinct_data_distinct_names

    x = torch.randn(2)
    progs = {
        "a": torch.export.export(Counter(1.0), (x,)),
        "b": torch.export.export(Counter(2.0), (x,)),
        "c": torch.export.export(Counter(1.0), (x,)),
    }
    renames = give_distinct_data_distinct_names(progs)
    assert renames == {("b", "w"): "w.b"}  # c holds a's data; the written buffer is state
    assert torch.equal(progs["b"].state_dict["w.b"], torch.full((2,), 2.0))
    assert "w" not in progs["b"].state_dict and "count" in progs["b"].state_dict
    assert {s.target for s in progs["b"].graph_signature.input_specs} >= {"w.b", "count"}
    assert progs["b"].module()(x).shape == (2,)


def test_the_renaming_does_not_depend_on_the_order_methods_come_in():
    from etfold.exir.emit.external_constants import give_distinct_data_distinct_names

    x = torch.randn(2)

    def programs(order):
        values = {"a": 1.0, "b": 2.0, "c": 1.0}
        return {m: torch.export.export(Counter(values[m]), (x,)) for m in order}

    assert give_distinct_data_distinct_names(programs("abc")) == {("b", "w"): "w.b"}
    assert give_distinct_data_distinct_names(programs("bca")) == {("b", "w"): "w.b"}
