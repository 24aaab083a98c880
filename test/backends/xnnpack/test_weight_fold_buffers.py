# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""XNNPACK weight fold across methods: buffers, shared constants, the marking step.

A buffer seeds a fold only when `etfold.exir.to_edge_transform_and_lower` (which
sees every method) proved that no method writes it and no other method reads it.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from executorch.exir import ExecutorchBackendConfig
from executorch.exir import to_edge_transform_and_lower as upstream_lower
from executorch.exir.passes import MemoryPlanningPass
from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack.partition.weight_fold import FOLD
from etfold.decisions import collect_decisions
from etfold.exir import to_edge_transform_and_lower as etfold_lower
from etfold.exir.program.buffer_marks import BUFFER_FOLD_BLOCKERS, mark_buffer_fold_blockers
from etfold.exir.program.lower import MARKING_STEPS
from etfold.harness.xnnpack_runner import assert_close, export_method, lower_xnnpack

ATOL = 1e-4


def _outside(ops, op: str) -> bool:
    """`op` (any overload: `.default` at Edge, `.out` after emission) runs outside delegates."""
    return any(name.startswith(op + ".") for name in ops)


def _eager(module, method, inputs):
    with torch.no_grad():
        out = getattr(module, method)(*inputs)
    return [out] if isinstance(out, torch.Tensor) else list(out)


def _declined(decisions) -> list[str]:
    return [d.detail for d in decisions if d.fold == FOLD and not d.applied]


def _applied(decisions) -> list[str]:
    return [d.where for d in decisions if d.fold == FOLD and d.applied]


def _hook(program):
    return XnnpackPartitioner().transform_for_pre_decomposition(program)


def _placeholder(program, fqn):
    name = next(s.arg.name for s in program.graph_signature.input_specs if s.target == fqn)
    return next(n for n in program.graph.nodes if n.name == name)


# ---------------------------------------------------------------- the marking step


def test_marking_step_is_registered_in_etfold_lower():
    assert mark_buffer_fold_blockers in MARKING_STEPS


@torch.library.custom_op("etfold_weight_fold_test::scale_", mutates_args=("buffer",))
def _scale_(buffer: torch.Tensor, factor: float) -> None:
    buffer.mul_(factor)


@_scale_.register_fake
def _(buffer, factor):
    return None


class _Cache(torch.nn.Module):
    """`read` uses the buffer as a weight; the other methods write it in different ways."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.randn(8, 16))
        self.register_buffer("untouched", torch.randn(8, 16))

    def read(self, x):
        return torch.nn.functional.linear(x, self.w.cumsum(0)) + torch.nn.functional.linear(
            x, self.untouched * 2
        )

    def copy(self, x):
        self.w.copy_(x)
        return x.cumsum(0)  # stays on portable kernels, so the method plans activations too

    def index_put(self, x, i):
        self.w.index_put_((i,), x[:1])
        return x + 0

    def view_add(self, x):
        self.w[:2].add_(x[:2])
        return x + 0

    def custom(self, x):
        _scale_(self.w, 0.5)
        return x + 0

    def also_read(self, x):
        return x + self.w


_WRITERS = {
    "copy": (lambda: (torch.randn(8, 16),), "aten.copy_.default"),
    "index_put": (lambda: (torch.randn(8, 16), torch.tensor([3])), "aten.index_put_.default"),
    "view_add": (lambda: (torch.randn(8, 16),), "aten.add_.Tensor"),
    "custom": (lambda: (torch.randn(8, 16),), "etfold_weight_fold_test.scale_.default"),
}


@pytest.mark.parametrize("writer", sorted(_WRITERS))
def test_declines_when_another_method_writes_the_buffer(writer):
    make_inputs, op = _WRITERS[writer]
    torch.manual_seed(0)
    module = _Cache().eval()
    x = torch.randn(4, 16)
    programs = {
        "read": export_method(module, "read", (x,)),
        writer: export_method(module, writer, make_inputs()),
    }
    mark_buffer_fold_blockers(programs)
    blockers = (
        f"method `{writer}` may write it ({op})",
        f"methods {', '.join(sorted(programs))} all read it",
    )
    assert _placeholder(programs["read"], "w").meta[BUFFER_FOLD_BLOCKERS] == blockers
    assert _placeholder(programs["read"], "untouched").meta[BUFFER_FOLD_BLOCKERS] == ()
    with collect_decisions() as decisions:
        folded = _hook(programs["read"])
    assert _declined(decisions) == [f"weight stays dynamic: buffer `w`: {'; '.join(blockers)}"]
    assert _applied(decisions) == ["linear_1.weight"]  # the untouched buffer still folds
    cumsums = [n for n in folded.graph.nodes if n.target == torch.ops.aten.cumsum.default]
    assert len(cumsums) == 1 and cumsums[0].args[0].op == "placeholder"
    lowered = lower_xnnpack(
        {"read": folded}, [XnnpackPartitioner(fold_weights=False)], lower=upstream_lower
    )
    assert_close(lowered.run(x, method="read"), _eager(module, "read", (x,)), atol=ATOL)


def test_declines_when_several_methods_read_the_buffer():
    module = _Cache().eval()
    x = torch.randn(4, 16)
    programs = {
        "read": export_method(module, "read", (x,)),
        "also_read": export_method(module, "also_read", (torch.randn(8, 16),)),
    }
    mark_buffer_fold_blockers(programs)
    with collect_decisions() as decisions:
        _hook(programs["read"])
    assert _declined(decisions) == [
        "weight stays dynamic: buffer `w`: methods also_read, read all read it"
    ]


def test_a_placeholder_without_users_is_not_a_read():
    class Unused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.randn(8, 16))

        def forward(self, x):
            return torch.nn.functional.linear(x, self.w * 2)

        def other(self, x):
            return x + 1

    module = Unused()
    programs = {
        "forward": export_method(module, "forward", (torch.randn(4, 16),)),
        "other": export_method(module, "other", (torch.randn(2),)),
    }
    mark_buffer_fold_blockers(programs)
    assert _placeholder(programs["forward"], "w").meta[BUFFER_FOLD_BLOCKERS] == ()


def test_marks_are_recomputed_not_accumulated():
    module = _Cache().eval()
    read = export_method(module, "read", (torch.randn(4, 16),))
    mark_buffer_fold_blockers(
        {"read": read, "copy": export_method(module, "copy", (torch.randn(8, 16),))}
    )
    assert _placeholder(read, "w").meta[BUFFER_FOLD_BLOCKERS]
    mark_buffer_fold_blockers({"read": read})
    assert _placeholder(read, "w").meta[BUFFER_FOLD_BLOCKERS] == ()


def test_a_functionalized_mutation_counts_as_a_write():
    module = _Cache().eval()
    copy = export_method(module, "copy", (torch.randn(8, 16),)).run_decompositions({})
    read = export_method(module, "read", (torch.randn(4, 16),))
    mark_buffer_fold_blockers({"read": read, "copy": copy})
    assert _placeholder(read, "w").meta[BUFFER_FOLD_BLOCKERS][0] == (
        "method `copy` may write it (a functionalized mutation)"
    )


def test_declines_when_the_buffer_was_never_judged():
    torch.manual_seed(0)
    module = spectral_norm(torch.nn.Linear(16, 8)).eval()
    x = torch.randn(4, 16)
    program = torch.export.export(module, (x,))
    with collect_decisions() as decisions:
        _hook(program)
    weight = [d.detail for d in decisions if d.where == "linear.weight" and not d.applied]
    assert weight and all("was not judged across methods" in reason for reason in weight)
    # through upstream's entry point the partitioner judges the lowering's methods itself
    lowered = lower_xnnpack(
        torch.export.export(module, (x,)), [XnnpackPartitioner()], lower=upstream_lower
    )
    assert not lowered.ops_outside()
    assert_close(lowered.run(x), _eager(module, "forward", (x,)), atol=ATOL)


def test_declines_when_its_own_method_writes_the_buffer():
    class SelfWrite(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.randn(8, 16))

        def forward(self, x):
            self.w[:1].mul_(0.5)
            return torch.nn.functional.linear(x, self.w.cumsum(0))

    program = export_method(SelfWrite(), "forward", (torch.randn(4, 16),))
    mark_buffer_fold_blockers({"forward": program})
    with collect_decisions() as decisions:
        assert _hook(program) is program
    assert _declined(decisions) == [
        "weight stays dynamic: `w` is written in this method (aten.mul_.Tensor)"
    ]


def test_declines_when_a_parameter_is_shared_across_methods():
    class TwoMethods(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = weight_norm(torch.nn.Linear(16, 8))

        def forward(self, x):
            return self.lin(x)

        def other(self, x):
            return self.lin(x) * 2

    torch.manual_seed(0)
    module = TwoMethods().eval()
    x = torch.randn(4, 16)
    programs = {
        "forward": export_method(module, "forward", (x,)),
        "other": export_method(module, "other", (x,)),
    }
    with collect_decisions() as decisions:
        lowered = lower_xnnpack(programs, [XnnpackPartitioner()], lower=etfold_lower)
    declined = _declined(decisions)
    assert len(declined) >= 2 and all("is read by several methods" in r for r in declined)
    for method in programs:
        assert_close(lowered.run(x, method=method), _eager(module, method, (x,)), atol=ATOL)


# ---------------------------------------------------------------- what buffers make possible


@pytest.mark.parametrize(
    "parametrize",
    [pytest.param(spectral_norm, id="spectral_norm"), pytest.param(orthogonal, id="orthogonal")],
)
def test_parametrizations_with_buffers_fold_through_etfold_lower(parametrize):
    torch.manual_seed(0)
    module = parametrize(torch.nn.Linear(16, 16)).eval()
    x = torch.randn(4, 16)
    with collect_decisions() as decisions:
        lowered = lower_xnnpack(
            export_method(module, "forward", (x,)), [XnnpackPartitioner()], lower=etfold_lower
        )
    assert _applied(decisions) == ["linear.weight"]
    assert lowered.delegates() == 1
    assert lowered.ops_outside() == Counter()
    assert_close(lowered.run(x), _eager(module, "forward", (x,)), atol=ATOL)


class _KvBlock(torch.nn.Module):
    """An in-place cache write beside a weight_norm projection that folds."""

    def __init__(self):
        super().__init__()
        self.proj = weight_norm(torch.nn.Linear(16, 16))
        self.register_buffer("cache", torch.zeros(4, 16))

    def forward(self, x, position):
        k = self.proj(x)
        self.cache.index_put_((position,), k)
        return self.cache.sum(0, keepdim=True) + k


def test_in_place_buffer_write_stays_a_mutation_and_state_carries_across_calls():
    torch.manual_seed(0)
    module = _KvBlock().eval()
    steps = [(torch.randn(1, 16), torch.tensor([i])) for i in range(3)]
    with torch.no_grad():  # a cache written from a parameter product must not look trainable
        program = export_method(module, "forward", steps[0])
    with collect_decisions() as decisions:
        lowered = lower_xnnpack(program, [XnnpackPartitioner()], lower=etfold_lower)
    assert _applied(decisions) == ["linear.weight"]
    signature = lowered.edge.exported_program().graph_signature
    assert list(signature.buffers_to_mutate.values()) == ["cache"]
    eager = _KvBlock()
    eager.load_state_dict(module.state_dict())
    for inputs in steps:
        assert_close(lowered.run(*inputs), _eager(eager, "forward", inputs), atol=ATOL)


def _shared_allocations(executorch, fqn: str) -> dict[str, tuple[int, int]]:
    found = {}
    for plan in executorch.executorch_program.execution_plan:
        for value in plan.values:
            info = getattr(value.val, "extra_tensor_info", None)
            if (
                info is not None
                and info.fully_qualified_name == fqn
                and value.val.allocation_info is not None
            ):
                found[plan.name] = (
                    value.val.allocation_info.memory_id,
                    value.val.allocation_info.memory_offset_low,
                )
    return found


def test_a_buffer_written_by_one_method_and_read_by_another_keeps_its_shared_allocation():
    torch.manual_seed(0)
    module = _Cache().eval()
    x = torch.randn(4, 16)

    def lower(fold_weights):
        # the planning pass keeps cross-method state: one per lowering
        config = ExecutorchBackendConfig(
            memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True),
            emit_mutable_buffer_names=True,
        )
        programs = {
            "read": export_method(module, "read", (x,)),
            "copy": export_method(module, "copy", (torch.randn(8, 16),)),
        }
        partitioners = [XnnpackPartitioner(fold_weights=fold_weights)]
        return lower_xnnpack(programs, partitioners, lower=etfold_lower, executorch_config=config)

    with collect_decisions() as decisions:
        hooked = lower(True)
    assert "weight stays dynamic: `w` is read by several methods" in _declined(decisions)
    allocations = _shared_allocations(hooked.executorch, "w")
    assert set(allocations) == {"read", "copy"}
    assert len(set(allocations.values())) == 1
    assert _shared_allocations(lower(False).executorch, "w") == allocations

    fresh = lower_xnnpack(
        {
            "read": export_method(module, "read", (x,)),
            "copy": export_method(module, "copy", (torch.randn(8, 16),)),
        },
        [XnnpackPartitioner()],
        lower=etfold_lower,
    )
    assert_close(fresh.run(x, method="read"), _eager(module, "read", (x,)), atol=ATOL)


# ---------------------------------------------------------------- shared constants across methods


class _TiedAcrossMethods(torch.nn.Module):
    def __init__(self, with_conv: bool):
        super().__init__()
        self.embed = torch.nn.Embedding(512, 128)
        self.conv = (
            weight_norm(torch.nn.Conv1d(128, 128, 3, padding=1), dim=2) if with_conv else None
        )

    def forward(self, tokens):
        return self.embed(tokens)

    def logits(self, h):
        if self.conv is not None:
            h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return h @ self.embed.weight.t()


@pytest.mark.parametrize("with_conv", [False, True], ids=["tied_only", "with_weight_norm_conv"])
def test_embedding_shared_by_a_lookup_and_a_transposed_matmul_in_two_methods(with_conv):
    torch.manual_seed(0)
    module = _TiedAcrossMethods(with_conv).eval()
    tokens = torch.tensor([[1, 7, 300]])
    h = torch.randn(1, 3, 128)

    def programs():
        return {
            "forward": export_method(module, "forward", (tokens,)),
            "logits": export_method(module, "logits", (h,)),
        }

    with collect_decisions() as decisions:
        hooked = lower_xnnpack(programs(), [XnnpackPartitioner()], lower=etfold_lower)
    unhooked = lower_xnnpack(
        programs(), [XnnpackPartitioner(fold_weights=False)], lower=etfold_lower
    )
    assert any("`embed.weight` is read by several methods" in r for r in _declined(decisions))
    if with_conv:
        assert _applied(decisions) == ["conv1d.weight"]
        assert _outside(unhooked.ops_outside("logits"), "aten.convolution")
        assert not _outside(hooked.ops_outside("logits"), "aten.convolution")
    else:
        assert _applied(decisions) == []
        assert hooked.pte_bytes == unhooked.pte_bytes
    assert_close(hooked.run(tokens), _eager(module, "forward", (tokens,)), atol=ATOL)
    assert_close(hooked.run(h, method="logits"), _eager(module, "logits", (h,)), atol=1e-3)
