# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""etfold's to_edge_transform_and_lower: cross-method marks before upstream runs."""

from __future__ import annotations

import inspect

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import EdgeProgramManager
from executorch.exir import to_edge_transform_and_lower as upstream_to_edge_transform_and_lower

from etfold.exir import to_edge_transform_and_lower
from etfold.exir.program import lower
from etfold.exir.program.method_marks import SHARED_ACROSS_METHODS
from etfold.harness.xnnpack_runner import (
    assert_close,
    eager_outputs,
    export_method,
    load_program,
    lower_xnnpack,
)

torch.manual_seed(0)


class Methods(torch.nn.Module):
    """w: read by forward and decode; u, scale: by decode and score; v: forward only."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.u = torch.nn.Parameter(torch.randn(8))
        self.v = torch.nn.Parameter(torch.randn(8))
        self.register_buffer("scale", torch.rand(8) + 0.5)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.w) * self.v

    def decode(self, x):
        return torch.nn.functional.linear(x, self.w) + self.u * self.scale

    def score(self, x):
        return x * self.u * self.scale


def programs(model, x, methods=("forward", "decode", "score")):
    return {m: export_method(model, m, (x,)) for m in methods}


def marks(ep) -> dict[str, bool]:
    fqn = {s.arg.name: s.target for s in ep.graph_signature.input_specs}
    return {
        fqn[n.name]: n.meta.get(SHARED_ACROSS_METHODS, False)
        for n in ep.graph.find_nodes(op="placeholder")
        if fqn[n.name] is not None
    }


class RecordingPartitioner(XnnpackPartitioner):
    """Upstream's partitioner that notes the marks its pre-decomposition hook sees."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def transform_for_pre_decomposition(self, exported_program):
        self.seen.append(marks(exported_program))
        return exported_program


def undecorated(function, name="to_edge_transform_and_lower"):
    """Upstream's API sits under a logging decorator that hides its signature."""
    cells = [c.cell_contents for c in function.__closure__ or ()]
    return next((f for f in cells if getattr(f, "__name__", None) == name), function)


def test_signature_is_upstreams_plus_the_keyword_only_speedups_switch():
    ours = dict(inspect.signature(to_edge_transform_and_lower).parameters)
    theirs = inspect.signature(undecorated(upstream_to_edge_transform_and_lower)).parameters
    switch = ours.pop("speedups")
    assert switch.kind is inspect.Parameter.KEYWORD_ONLY and switch.default is None
    assert "partitioner" in theirs
    assert list(ours) == list(theirs)
    assert [p.default for p in ours.values()] == [p.default for p in theirs.values()]


def test_marks_constants_several_methods_read_before_the_hook_runs():
    model, x = Methods().eval(), torch.randn(2, 8)
    partitioner = RecordingPartitioner()
    lowered = lower_xnnpack(programs(model, x), [partitioner], lower=to_edge_transform_and_lower)
    by_method = dict(zip(("forward", "decode", "score"), partitioner.seen, strict=True))
    shared = {"w": True, "u": True, "v": False, "scale": True}
    assert by_method == {"forward": shared, "decode": shared, "score": shared}
    for method in by_method:
        assert_close(lowered.run(x, method=method), eager_outputs(model, (x,), method), atol=1e-4)


def test_unused_placeholder_is_not_a_read():
    model, x = Methods().eval(), torch.randn(2, 8)
    progs = programs(model, x, ("forward", "score"))
    assert all("v" in marks(ep) and "w" in marks(ep) for ep in progs.values())  # lifted in both
    lower.mark_constants_shared_across_methods(progs)
    assert marks(progs["forward"]) == {"w": False, "u": False, "v": False, "scale": False}
    assert marks(progs["score"]) == {"w": False, "u": False, "v": False, "scale": False}


def test_single_method_marks_nothing():
    model, x = Methods().eval(), torch.randn(2, 8)
    partitioner = RecordingPartitioner()
    lowered = lower_xnnpack(
        export_method(model, "decode", (x,)), [partitioner], lower=to_edge_transform_and_lower
    )
    assert partitioner.seen == [{"w": False, "u": False, "v": False, "scale": False}]
    assert_close(lowered.run(x), eager_outputs(model, (x,), "decode"), atol=1e-4)


def test_marks_are_recomputed_not_accumulated():
    model, x = Methods().eval(), torch.randn(2, 8)
    progs = programs(model, x)
    lower.mark_constants_shared_across_methods(progs)
    assert marks(progs["forward"])["w"]
    lower.mark_constants_shared_across_methods({"forward": progs["forward"]})
    assert not any(marks(progs["forward"]).values())


def test_marking_steps_run_in_order_on_the_method_dict_before_upstream(monkeypatch):
    model, x = Methods().eval(), torch.randn(2, 8)
    calls = []

    def after_shared_marks(by_method):
        calls.append(("step", sorted(by_method), marks(by_method["decode"])["w"]))

    def upstream(programs, **kwargs):
        calls.append(("upstream",))
        return upstream_to_edge_transform_and_lower(programs, **kwargs)

    monkeypatch.setattr(lower, "MARKING_STEPS", (*lower.MARKING_STEPS, after_shared_marks))
    monkeypatch.setattr(lower, "_upstream_to_edge_transform_and_lower", upstream)
    edge = to_edge_transform_and_lower(programs(model, x), partitioner=[XnnpackPartitioner()])
    assert calls == [("step", ["decode", "forward", "score"], True), ("upstream",)]
    assert type(edge) is EdgeProgramManager


def test_the_manager_and_the_ones_derived_from_it_are_upstreams():
    model, x = Methods().eval(), torch.randn(2, 8)
    edge = to_edge_transform_and_lower(export_method(model, "forward", (x,)))
    assert type(edge) is EdgeProgramManager
    assert type(edge.transform([])) is EdgeProgramManager
    derived = edge.to_backend(XnnpackPartitioner())
    assert type(derived) is EdgeProgramManager
    runtime = load_program(derived.to_executorch())
    assert_close(list(runtime.run_method("forward", (x,))), eager_outputs(model, (x,)), atol=1e-4)


def _fingerprint(program) -> tuple:
    """Graph code, signature, every node's metadata (keys and the objects held) and the
    state tensors' values: what a user could observe of their ExportedProgram."""
    meta = [
        (node.name, tuple(sorted((key, id(value)) for key, value in node.meta.items())))
        for node in program.graph.nodes
    ]
    state = {k: v.detach().clone() for k, v in program.state_dict.items()}
    return program.graph_module.code, str(program.graph_signature), meta, state


def _same(before: tuple, after: tuple) -> bool:
    code, signature, meta, state = before
    return (
        (code, signature, meta) == after[:3]
        and state.keys() == after[3].keys()
        and all(torch.equal(state[k], after[3][k]) for k in state)
    )


class GainWritten(torch.nn.Module):
    """A weight-normed conv (the weight fold fires), an fp16 GELU (the widening fires)
    and a buffer written in place that another method reads (the buffer marks)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 4, 3))
        self.register_buffer("gain", torch.ones(4))

    def forward(self, x):
        self.gain.mul_(0.5)
        return torch.nn.functional.gelu(self.conv(x).half()).float()

    def read(self, x):
        return self.conv(x) * self.gain.reshape(-1, 1)


def test_the_users_programs_are_unchanged_by_lowering():
    from etfold.backends.xnnpack import XnnpackPartitioner as EtfoldPartitioner

    model, x = GainWritten().eval(), torch.randn(1, 4, 8)
    users = programs(Methods().eval(), torch.randn(2, 8))
    users.update({m: export_method(model, m, (x,)) for m in ("forward", "read")})
    before = {m: _fingerprint(p) for m, p in users.items()}
    to_edge_transform_and_lower(users, partitioner=[EtfoldPartitioner()])
    assert all(_same(before[m], _fingerprint(p)) for m, p in users.items())


# ---------------------------------------------------------------- upstream's lowering, seen from a hook


class MethodsSeen(XnnpackPartitioner):
    """Upstream's partitioner noting what a hook learns of the lowering it runs in."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def transform_for_pre_decomposition(self, exported_program):
        from etfold.exir.program.upstream_lowering import upstream_lowering_in_progress

        lowering = upstream_lowering_in_progress()
        self.seen.append((lowering.method, sorted(lowering.programs)) if lowering else None)
        return exported_program


def test_a_hook_inside_upstreams_lowering_sees_every_method_and_its_own():
    model, x = Methods().eval(), torch.randn(2, 8)
    partitioner = MethodsSeen()
    upstream_to_edge_transform_and_lower(programs(model, x), partitioner=[partitioner])
    methods = ["decode", "forward", "score"]
    assert sorted(partitioner.seen) == [(m, methods) for m in methods]


def test_a_hook_called_outside_a_lowering_sees_none():
    from etfold.exir.program.upstream_lowering import upstream_lowering_in_progress

    assert upstream_lowering_in_progress() is None
    partitioner = MethodsSeen()
    partitioner.transform_for_pre_decomposition(
        export_method(Methods(), "forward", (torch.randn(2, 8),))
    )
    assert partitioner.seen == [None]


def test_upstream_still_holds_the_lowerings_methods_where_the_hook_reads_them():
    """Pins the upstream shape `upstream_lowering` relies on."""
    from executorch.exir.program import _program

    from etfold.exir.program.upstream_lowering import lowering_code

    code = _program._gen_edge_manager_for_partitioners.__code__
    assert {"aten_programs", "name"} <= set(code.co_varnames)
    assert "_apply_pre_decomposition_transforms" in code.co_names
    assert lowering_code(_program._gen_edge_manager_for_partitioners) is code


def _renamed_lowering(partitioner, programs, config, constant_methods, generate_etrecord=False):
    """Upstream's lowering as a later release might write it: other local names."""
    for method, program in programs.items():
        _apply_pre_decomposition_transforms(program, partitioner.get(method, []))  # noqa: F821


def test_the_guard_names_what_a_changed_upstream_lowering_no_longer_holds():
    from etfold.exir.program.upstream_lowering import UpstreamLoweringChanged, lowering_code

    with pytest.raises(UpstreamLoweringChanged) as raised:
        lowering_code(_renamed_lowering)
    message = str(raised.value)
    assert "parameter `aten_programs`" in message and "local `name`" in message
    assert "call of" not in message and "etfold.exir.to_edge_transform_and_lower" in message
    with pytest.raises(UpstreamLoweringChanged, match="is gone"):
        lowering_code(None)


def test_a_hook_fails_loudly_when_upstream_no_longer_holds_the_methods(monkeypatch):
    """Through upstream's entry point a changed upstream raises, never marks nothing
    silently; etfold's entry point marks first, so its hooks never read the frame."""
    from etfold.backends.xnnpack import XnnpackPartitioner as EtfoldPartitioner
    from etfold.exir.program import upstream_lowering

    monkeypatch.setattr(upstream_lowering, "_UPSTREAM_LOWERING", _renamed_lowering)
    with pytest.raises(upstream_lowering.UpstreamLoweringChanged):
        upstream_lowering.upstream_lowering_in_progress()
    model, x = Methods().eval(), torch.randn(2, 8)
    with pytest.raises(upstream_lowering.UpstreamLoweringChanged):
        upstream_to_edge_transform_and_lower(programs(model, x), partitioner=[EtfoldPartitioner()])
    to_edge_transform_and_lower(programs(model, x), partitioner=[EtfoldPartitioner()])


def test_the_etfold_partitioner_marks_a_copy_through_upstreams_entry_point():
    """Through upstream's entry point the hook gets the user's program: it marks a copy."""
    from etfold.backends.xnnpack import XnnpackPartitioner as EtfoldPartitioner

    model, x = Methods().eval(), torch.randn(2, 8)
    users = programs(model, x)
    before = {m: _fingerprint(p) for m, p in users.items()}
    seen = []

    class Noting(EtfoldPartitioner):
        def transform_for_pre_decomposition(self, exported_program):
            judged = self._judged_across_methods(exported_program)
            seen.append((judged is not exported_program, marks(judged)))
            return super().transform_for_pre_decomposition(exported_program)

    upstream_to_edge_transform_and_lower(users, partitioner=[Noting()])
    shared = {"w": True, "u": True, "v": False, "scale": True}
    assert seen == [(True, shared)] * 3
    assert all(_same(before[m], _fingerprint(p)) for m, p in users.items())


# ---------------------------------------------------------------- lowering scopes


def test_registered_scopes_are_entered_around_the_call_and_left_when_it_raises(monkeypatch):
    from contextlib import contextmanager

    from etfold.exir.program import lowering_scopes

    events = []

    @contextmanager
    def scope():
        events.append("enter")
        try:
            yield
        finally:
            events.append("exit")

    def failing(programs, **kwargs):
        events.append("upstream")
        raise RuntimeError("planted")

    monkeypatch.setattr(lowering_scopes, "_scopes", [])
    lowering_scopes.register_lowering_scope(scope)
    lowering_scopes.register_lowering_scope(scope)
    assert lowering_scopes.registered_lowering_scopes() == (scope,)
    monkeypatch.setattr(lower, "_upstream_to_edge_transform_and_lower", failing)
    with pytest.raises(RuntimeError, match="planted"):
        to_edge_transform_and_lower(export_method(Methods(), "forward", (torch.randn(2, 8),)))
    assert events == ["enter", "upstream", "exit"]
    lowering_scopes.unregister_lowering_scope(scope)
    assert lowering_scopes.registered_lowering_scopes() == ()


def test_the_xnnpack_install_plugs_its_scope_in():
    from etfold.backends.xnnpack import install
    from etfold.exir.program.lowering_scopes import registered_lowering_scopes

    assert install.holds_released_on_exit in registered_lowering_scopes()
