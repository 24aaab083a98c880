# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""conv_arguments: every conv overload and linear, ATen and Edge, positional or keyword."""

from __future__ import annotations

import pytest
import torch
from executorch.exir import to_edge
from executorch.exir.dialects.edge._ops import EdgeOpOverload

from etfold.backends.arm._passes.conv_arguments import (
    GROUPS_NOT_CONSTANT,
    NOT_A_LAYER,
    ConvArguments,
    conv_arguments,
    set_conv_argument,
)
from etfold.decisions import Declined


def _layer_node(module, x):
    graph = torch.export.export(module.eval(), (x,)).graph
    (node,) = [n for n in graph.nodes if isinstance(conv_arguments(n), ConvArguments)]
    return node


_CASES = {
    # module, input, (linear, transposed, groups, stride, padding, padded, weight axis)
    "conv1d": (
        torch.nn.Conv1d(4, 6, 3, stride=2),
        (1, 4, 9),
        (False, False, 1, (2,), (0,), False, 0),
    ),
    "conv2d_grouped_padded": (
        torch.nn.Conv2d(4, 6, 3, padding=1, groups=2),
        (1, 4, 5, 5),
        (False, False, 2, (1, 1), (1, 1), True, 0),
    ),
    "conv2d_same": (
        torch.nn.Conv2d(4, 6, 3, padding="same"),
        (1, 4, 5, 5),
        (False, False, 1, (1, 1), "same", True, 0),
    ),
    "conv_transpose2d": (
        torch.nn.ConvTranspose2d(4, 6, 2, stride=2, groups=2),
        (1, 4, 3, 3),
        (False, True, 2, (2, 2), (0, 0), False, 1),
    ),
    "linear": (torch.nn.Linear(4, 6), (2, 4), (True, False, 1, (), (), False, 0)),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_reads_each_overload(case):
    module, shape, expected = _CASES[case]
    node = _layer_node(module, torch.randn(*shape))
    arguments = conv_arguments(node)
    linear, transposed, groups, stride, padding, padded, weight_axis = expected
    assert (arguments.linear, arguments.transposed, arguments.groups) == (
        linear,
        transposed,
        groups,
    )
    assert (arguments.stride, arguments.padding, arguments.padded) == (stride, padding, padded)
    assert arguments.weight_channel_axis == weight_axis
    assert arguments.input is node.args[0] and arguments.weight is node.args[1]
    assert arguments.output_channel_axis(3) == (2 if linear else 1)


def test_edge_convolution_reads_as_its_aten_overload():
    module = torch.nn.Conv2d(4, 6, 3, padding=1, groups=2).eval()
    edge = to_edge(torch.export.export(module, (torch.randn(1, 4, 5, 5),)))
    graph = edge.exported_program().graph
    (node,) = [n for n in graph.nodes if isinstance(conv_arguments(n), ConvArguments)]
    arguments = conv_arguments(node)
    assert isinstance(node.target, EdgeOpOverload)
    assert (arguments.groups, arguments.padding, arguments.transposed) == (2, (1, 1), False)


def test_keyword_arguments_and_defaults():
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    node = graph.call_function(torch.ops.aten.conv2d.default, (x, w), {"groups": 3})
    arguments = conv_arguments(node)
    assert (arguments.bias, arguments.groups, arguments.stride, arguments.padding) == (
        None,
        3,
        (1, 1),
        (0, 0),
    )


def test_declines_what_is_not_a_layer_or_has_no_constant_groups():
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    relu = graph.call_function(torch.ops.aten.relu.default, (x,))
    symbolic = graph.call_function(torch.ops.aten.conv2d.default, (x, w), {"groups": relu})
    assert conv_arguments(relu) == Declined(NOT_A_LAYER)
    assert conv_arguments(x) == Declined(NOT_A_LAYER)
    assert conv_arguments(3) == Declined(NOT_A_LAYER)
    assert conv_arguments(symbolic) == Declined(GROUPS_NOT_CONSTANT)


def test_set_conv_argument_passes_by_position():
    graph = torch.fx.Graph()
    x, w, b, new = (graph.placeholder(name) for name in ("x", "w", "b", "new"))
    positional = graph.call_function(torch.ops.aten.conv2d.default, (x, w, b))
    short = graph.call_function(torch.ops.aten.linear.default, (x, w))
    keywords = graph.call_function(torch.ops.aten.conv2d.default, (x,), {"weight": w, "groups": 2})
    set_conv_argument(positional, "bias", new)
    set_conv_argument(short, "bias", new)
    set_conv_argument(short, "weight", b)
    set_conv_argument(keywords, "bias", new)
    assert positional.args == (x, w, new) and positional.kwargs == {}
    assert short.args == (x, b, new) and short.kwargs == {}
    assert keywords.args == (x, w, new) and keywords.kwargs == {"groups": 2}
    assert conv_arguments(short).bias is new and conv_arguments(keywords).groups == 2


_WITHOUT_AND_WITH_BIAS = {
    "conv1d": (lambda bias: torch.nn.Conv1d(4, 6, 3, bias=bias), (1, 4, 9)),
    "conv2d": (lambda bias: torch.nn.Conv2d(4, 6, 3, bias=bias), (1, 4, 5, 5)),
    "depthwise": (lambda bias: torch.nn.Conv2d(4, 4, 3, groups=4, bias=bias), (1, 4, 5, 5)),
    "grouped": (lambda bias: torch.nn.Conv2d(4, 6, 3, groups=2, bias=bias), (1, 4, 5, 5)),
    "transposed": (
        lambda bias: torch.nn.ConvTranspose2d(4, 6, 2, stride=2, bias=bias),
        (1, 4, 3, 3),
    ),
    "linear": (lambda bias: torch.nn.Linear(4, 6, bias=bias), (2, 4)),
}


@pytest.mark.parametrize("kind", list(_WITHOUT_AND_WITH_BIAS))
def test_a_bias_given_takes_the_form_torch_exports_with_a_bias(kind):
    make, shape = _WITHOUT_AND_WITH_BIAS[kind]
    without = _layer_node(make(False), torch.randn(*shape))
    with_bias = _layer_node(make(True), torch.randn(*shape))
    set_conv_argument(without, "bias", without.args[1])
    assert len(without.args) == len(with_bias.args) and without.kwargs == with_bias.kwargs == {}
    assert without.args[2] is without.args[1]
    assert without.args[3:] == with_bias.args[3:]
