# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The TOSA runner really runs the lowered graph on tosa_reference_model."""

import copy

import pytest
import torch

from etfold.harness.inspection import tosa_operator_counts, tosa_unsized_inputs
from etfold.harness.tosa_runner import (
    FP,
    INT,
    TosaResult,
    lower_module_tosa,
    lower_tosa,
    max_code_difference,
    output_scales,
    quantize_for_tosa,
    run_exported,
)
from etfold.harness.xnnpack_runner import eager_outputs, max_abs_error


class PlainConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


def _conv_and_input():
    torch.manual_seed(0)
    return PlainConv().eval(), torch.randn(1, 3, 8, 8)


def test_plain_conv_int_is_within_one_lsb_of_eager():
    module, x = _conv_and_input()
    reference = eager_outputs(module, (x,))
    quantized = quantize_for_tosa(module, (x,))
    quantized_reference = run_exported(quantized, (x,))
    program = lower_tosa(quantized)
    result = program.run(x)
    (lsb,) = output_scales(program)
    assert lsb is not None
    # against the same Q/DQ evaluated in torch only the final requantization may differ
    assert max_abs_error(result.outputs, quantized_reference) <= 1.0001 * lsb
    # against fp32 eager, input and weight quantization add at most about one more LSB
    assert max_abs_error(result.outputs, reference) <= 2.0001 * lsb
    assert [c.dtype for c in result.codes] == [torch.int8]
    assert program.operator_counts()["CONV2D"] == 1


def test_int_codes_dequantize_to_the_outputs():
    module, x = _conv_and_input()
    program, _ = lower_module_tosa(module, (x,), INT)
    result = program.run(x)
    output_node = program.exported_program.graph.output_node().args[0][0]
    _, scale, zero_point = output_node.args[:3]
    dequantized = (result.codes[0].to(torch.float32) - zero_point) * scale
    torch.testing.assert_close(dequantized, result.outputs[0], atol=0, rtol=0)


def test_perturbed_weight_makes_the_int_comparison_fail():
    module, x = _conv_and_input()
    reference = eager_outputs(module, (x,))
    perturbed = copy.deepcopy(module)
    with torch.no_grad():
        perturbed.conv.weight[0].add_(0.2)
    program, _ = lower_module_tosa(perturbed, (x,), INT)
    (lsb,) = output_scales(program)
    assert max_abs_error(program.run(x).outputs, reference) > 4 * lsb


def test_fp_profile_matches_eager_and_fails_when_perturbed():
    module, x = _conv_and_input()
    program, reference = lower_module_tosa(module, (x,), FP)
    assert max_abs_error(program.run(x).outputs, reference) < 1e-5
    perturbed = copy.deepcopy(module)
    with torch.no_grad():
        perturbed.conv.bias.add_(0.1)
    program, _ = lower_module_tosa(perturbed, (x,), FP)
    assert max_abs_error(program.run(x).outputs, reference) > 0.05


def test_runner_refuses_a_program_without_a_tosa_delegate():
    module, x = _conv_and_input()
    program = lower_tosa(quantize_for_tosa(module, (x,)))
    program.edge._edge_programs = {
        "forward": torch.export.export(module, (x,))
    }  # an undelegated program: nothing would run on the reference model
    with pytest.raises(RuntimeError, match="no TOSA delegate"):
        program.run(x)


def test_a_graph_with_an_unsized_dimension_is_refused_before_the_reference_model_runs():
    """The reference model aborts (and prints a debugger's backtrace for seconds) on a
    dynamic dimension; the runner names the input instead."""
    module, x = _conv_and_input()
    x = torch.cat((x, x))  # a batch of 1 would be specialized
    batch = torch.export.Dim("batch", min=1, max=4)
    exported = torch.export.export(module, (x,), dynamic_shapes=({0: batch},))
    program = lower_tosa(exported, FP)
    (graph,) = program.tosa_graphs
    (unsized,) = tosa_unsized_inputs(graph)
    assert unsized == "x [-1, 3, 8, 8]"
    with pytest.raises(RuntimeError, match="static shapes only"):
        program.run(x)
    static, _ = lower_module_tosa(module, (x,), FP)
    assert [tosa_unsized_inputs(g) for g in static.tosa_graphs] == [[]]


def test_operator_counts_read_the_flatbuffer():
    module, x = _conv_and_input()
    program, _ = lower_module_tosa(module, (x,), INT)
    (graph,) = program.tosa_graphs
    counts = tosa_operator_counts(graph)
    assert counts == program.operator_counts()
    assert counts["CONV2D"] == 1 and counts["RESCALE"] >= 1


class CarriedConv(torch.nn.Module):
    """state <- conv(x + state): calibration calls advance the state."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 1)
        self.register_buffer("state", torch.zeros(1, 3, 4, 4))

    def forward(self, x):
        y = self.conv(x + self.state)
        self.state.copy_(y)
        return y


def test_calibration_does_not_advance_the_programs_state():
    torch.manual_seed(0)
    module = CarriedConv().eval()
    x = torch.randn(1, 3, 4, 4)
    program = quantize_for_tosa(module, (x,), calibration=[(x,), (x,)])
    assert torch.equal(module.state, torch.zeros(1, 3, 4, 4))
    assert torch.equal(program.state_dict["state"], torch.zeros(1, 3, 4, 4))
    # the lowered program starts from the exported state, as eager does
    lowered = lower_tosa(program)
    lsb = output_scales(lowered)[-1]  # graph outputs: the state write-back, then the user output
    assert max_abs_error(lowered.run(x).outputs, eager_outputs(module, (x,))) <= 2.0001 * lsb


def _result(*codes):
    return TosaResult(outputs=[], codes=[torch.tensor(c, dtype=torch.int8) for c in codes])


def test_code_difference_counts_lsb_and_refuses_mismatches():
    assert max_code_difference(_result([1, -128, 127]), _result([1, -128, 127])) == 0
    assert max_code_difference(_result([1, -128]), _result([2, 127])) == 255
    with pytest.raises(AssertionError, match="outputs"):
        max_code_difference(_result([1], [2]), _result([1]))
    with pytest.raises(AssertionError, match="shape"):
        max_code_difference(_result([1, 2]), _result([[1, 2]]))
    floats = TosaResult(outputs=[], codes=[torch.tensor([float("nan")])])
    with pytest.raises(AssertionError, match="not integers"):
        max_code_difference(floats, floats)
