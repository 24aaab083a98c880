# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The XNNPACK runner really runs the serialized program on the runtime in the wheel."""

import copy

import pytest
import torch

from etfold.harness.xnnpack_runner import (
    assert_close,
    eager_outputs,
    export_method,
    lower_module_xnnpack,
    lower_xnnpack,
    max_abs_error,
)


class PlainConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


class TwoMethods(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.linear(x)

    def doubled(self, x):
        return 2 * self.linear(x)


def _conv_and_input():
    torch.manual_seed(0)
    return PlainConv().eval(), torch.randn(1, 3, 16, 16)


def test_plain_conv_matches_eager_on_the_runtime():
    module, x = _conv_and_input()
    program, reference = lower_module_xnnpack(module, (x,))
    assert program.delegates() == 1
    assert sum(program.ops_outside().values()) == 0
    assert program.pte_bytes > 0
    assert_close(program.run(x), reference, atol=1e-5)


def test_perturbed_weight_makes_the_comparison_fail():
    module, x = _conv_and_input()
    reference = eager_outputs(module, (x,))
    perturbed = copy.deepcopy(module)
    with torch.no_grad():
        perturbed.conv.weight[0, 0, 1, 1] += 0.05
    program, _ = lower_module_xnnpack(perturbed, (x,))
    assert max_abs_error(program.run(x), reference) > 1e-3
    with pytest.raises(AssertionError):
        assert_close(program.run(x), reference, atol=1e-5)


def test_runtime_output_follows_the_serialized_weights_not_the_module():
    module, x = _conv_and_input()
    program, reference = lower_module_xnnpack(module, (x,))
    with torch.no_grad():
        module.conv.weight.mul_(3.0)  # after lowering: the runtime must not see this
    assert_close(program.run(x), reference, atol=1e-5)
    assert max_abs_error(program.run(x), eager_outputs(module, (x,))) > 1e-2


def test_multi_method_program_runs_each_method():
    torch.manual_seed(0)
    module = TwoMethods().eval()
    x = torch.randn(2, 16)
    programs = {
        "forward": export_method(module, "forward", (x,)),
        "doubled": export_method(module, "doubled", (x,)),
    }
    program = lower_xnnpack(programs)
    assert_close(program.run(x, method="forward"), eager_outputs(module, (x,)), atol=1e-5)
    assert_close(
        program.run(x, method="doubled"), eager_outputs(module, (x,), "doubled"), atol=1e-5
    )
    assert program.delegates("doubled") == 1


def test_exported_methods_keep_the_modules_parameter_names():
    module = TwoMethods().eval()
    x = torch.randn(2, 16)
    names = [
        [
            spec.target
            for spec in export_method(module, method, (x,)).graph_signature.input_specs
            if spec.target
        ]
        for method in ("forward", "doubled")
    ]
    assert names == [["linear.weight", "linear.bias"]] * 2
    assert "forward" not in vars(module)  # the user's module keeps its own forward


class CumsumHead(torch.nn.Module):
    """A linear XNNPACK takes, then an op it does not: one op stays outside."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.cumsum(self.linear(x), dim=-1)


def test_ops_outside_are_read_from_the_lowered_program_not_the_emitted_one():
    torch.manual_seed(0)
    module = CumsumHead().eval()
    x = torch.randn(2, 8)
    program, reference = lower_module_xnnpack(module, (x,))
    assert program.delegates() == 1
    assert program.ops_outside() == {"aten.cumsum.default": 1}  # no alloc / .out from emission
    assert_close(program.run(x), reference, atol=1e-5)


def test_a_loaded_program_keeps_the_buffer_it_runs_from_alive():
    """The runtime points into the manager's buffer without copying it."""
    import gc
    import weakref

    from executorch.exir import to_edge_transform_and_lower

    from etfold.harness.xnnpack_runner import default_partitioners, load_program

    module, x = _conv_and_input()
    reference = eager_outputs(module, (x,))
    edge = to_edge_transform_and_lower(
        export_method(module, "forward", (x,)), partitioner=default_partitioners()
    )
    manager = edge.to_executorch()
    alive = weakref.ref(manager)
    loaded = load_program(manager)
    del edge, manager
    gc.collect()
    assert alive() is not None
    assert_close(loaded.run_method("forward", (x,)), reference, atol=1e-5)


# ---- the oracle itself: nothing non-finite or mismatched passes as a small error ----

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("actual", "expected"),
    [
        ([NAN], [1.0]),
        ([1.0], [NAN]),
        ([INF], [1.0]),
        ([1.0], [INF]),
        ([INF], [-INF]),
        ([NAN], [INF]),
        ([0.5, NAN], [0.5, 2.0]),
    ],
    ids=[
        "nan_out",
        "nan_expected",
        "inf_out",
        "inf_expected",
        "inf_sign",
        "nan_vs_inf",
        "late_nan",
    ],
)
def test_a_non_finite_mismatch_is_an_infinite_error(actual, expected):
    a, e = [torch.tensor(actual)], [torch.tensor(expected)]
    assert max_abs_error(a, e) == INF
    assert max_abs_error([torch.zeros(2), *a], [torch.zeros(2), *e]) == INF  # not the first output
    with pytest.raises(AssertionError):
        assert_close(a, e, atol=1e9)


def test_nan_and_inf_match_only_the_same_value_at_the_same_place():
    expected = [torch.tensor([NAN, INF, -INF, 1.0])]
    assert max_abs_error([torch.tensor([NAN, INF, -INF, 1.25])], expected) == 0.25
    assert_close([torch.tensor([NAN, INF, -INF, 1.0])], expected, atol=0)
    with pytest.raises(AssertionError):
        assert_close([torch.tensor([1.0, INF, -INF, NAN])], expected, atol=1e9)  # moved NaN


@pytest.mark.parametrize(
    ("actual", "expected", "what"),
    [
        ([torch.zeros(2, 3)], [torch.zeros(3, 2)], "shape"),
        ([torch.zeros(6)], [torch.zeros(1, 6)], "shape"),
        ([torch.zeros(2)], [torch.zeros(2, dtype=torch.float16)], "dtype"),
        ([torch.zeros(2, dtype=torch.int32)], [torch.zeros(2)], "dtype"),
        ([torch.zeros(2)], [torch.zeros(2), torch.zeros(2)], "outputs"),
        ([], [torch.zeros(2)], "outputs"),
    ],
    ids=["transposed", "broadcastable", "fp16", "int32", "fewer", "none"],
)
def test_a_shape_dtype_or_count_mismatch_fails(actual, expected, what):
    with pytest.raises(AssertionError, match=what):
        max_abs_error(actual, expected)
    with pytest.raises(AssertionError, match=what):
        assert_close(actual, expected, atol=1e9)


def test_empty_outputs_compare_equal_and_low_precision_errors_are_exact():
    assert max_abs_error([torch.zeros(0, 4)], [torch.zeros(0, 4)]) == 0.0
    half = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert max_abs_error([half], [half + 0.0078125]) == 0.0078125


class SharedRunningGain(torch.nn.Module):
    """Two methods that each read and update one buffer."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 3))

    def _step(self, x):
        y = self.linear(x) * self.gain.reshape(-1, 1)
        self.gain.mul_(0.5).add_(0.25 * y.detach().mean())
        return y

    def forward(self, x):
        return self._step(x)

    def half(self, x):  # export swaps `forward` for the method it exports
        return 0.5 * self._step(x)


def test_methods_see_the_mutable_buffer_another_method_wrote():
    """A method loaded lazily on its first call would re-initialize the shared buffer."""
    from etfold.harness.differential_xnnpack import executorch_config
    from etfold.harness.generated_cases import Built

    torch.manual_seed(4)
    module, x = SharedRunningGain().eval(), (torch.randn(1, 3, 4),)
    methods = {"forward": x, "half": x}
    programs = {name: export_method(module, name, x) for name in methods}
    lowered = lower_xnnpack(
        programs, executorch_config=executorch_config(Built(module, methods, []))
    )
    eager = copy.deepcopy(module)
    for method in ["forward", "half", "half", "forward", "half"]:
        with torch.no_grad():
            expected = [getattr(eager, method)(*x)]
        assert_close(lowered.run(*x, method=method), expected, atol=1e-5)
