# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""A convolution's or linear layer's arguments, read once for every Arm pass.

Every conv overload a pass can meet (conv1d/2d/3d and their string-padding
variants, conv_transpose1d/2d/3d, convolution; linear) is read through its own
schema, positional or keyword, defaults filled in, an Edge op as the ATen
overload it wraps. A linear is a layer with no spatial dims: weight [out, in],
output channels on its output's last axis. Out-channels lead the weight
(axis 0) except in a transposed conv, whose weight is [in, out / groups, ...].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from etfold.decisions import Declined
from etfold.exir.passes.graph_walk import underlying_op

_aten = torch.ops.aten
_CONVS = frozenset(
    {
        _aten.conv1d.default,
        _aten.conv2d.default,
        _aten.conv3d.default,
        _aten.conv1d.padding,
        _aten.conv2d.padding,
        _aten.conv3d.padding,
        _aten.convolution.default,
    }
)
_CONV_TRANSPOSES = frozenset(
    {
        _aten.conv_transpose1d.default,
        _aten.conv_transpose2d.input,
        _aten.conv_transpose3d.input,
    }
)
_LINEARS = frozenset({_aten.linear.default})

NOT_A_LAYER = "not a convolution or linear layer"
GROUPS_NOT_CONSTANT = "the conv's groups are not a constant integer"
TRANSPOSED_NOT_CONSTANT = "the conv's transposed flag is not a constant"


@dataclass(frozen=True)
class ConvArguments:
    """The arguments of one conv or linear call, as the op reads them."""

    node: Node
    input: object
    weight: object
    bias: object  # None: no bias
    linear: bool
    transposed: bool
    groups: int
    stride: tuple[int, ...]  # () for a linear
    padding: tuple[int, ...] | str  # a string for the "same"/"valid" overloads
    dilation: tuple[int, ...]
    output_padding: tuple[int, ...]

    @property
    def weight_channel_axis(self) -> int:
        """The axis of the weight that indexes output channels (per group, transposed)."""
        return 1 if self.transposed else 0

    def output_channel_axis(self, rank: int) -> int:
        """The output-channel axis of the layer's rank-`rank` output."""
        return rank - 1 if self.linear else 1

    @property
    def spatial_dims(self) -> int:
        """1, 2 or 3 for a conv (its stride's length); 0 for a linear."""
        return len(self.stride)

    @property
    def padded(self) -> bool:
        """Whether any border is padded ("same" counts as padded)."""
        if isinstance(self.padding, str):
            return self.padding != "valid"
        return any(p != 0 for p in self.padding)


def _bound(node: Node) -> dict[str, object]:
    """Argument name -> value as the call passes it, defaults filled in."""
    bound: dict[str, object] = {}
    for index, argument in enumerate(underlying_op(node.target)._schema.arguments):
        if index < len(node.args):
            bound[argument.name] = node.args[index]
        elif argument.name in node.kwargs:
            bound[argument.name] = node.kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


def _ints(value: object) -> tuple[int, ...] | str:
    if isinstance(value, (str, int)):
        return value if isinstance(value, str) else (value,)
    return tuple(value) if isinstance(value, (list, tuple)) else ()


def conv_arguments(node: object) -> ConvArguments | Declined:
    """The arguments of a conv or linear call, or Declined (not one, or groups and the
    transposed flag not constants)."""
    if not isinstance(node, Node) or node.op != "call_function":
        return Declined(NOT_A_LAYER)
    op = underlying_op(node.target)
    if op not in _CONVS | _CONV_TRANSPOSES | _LINEARS:
        return Declined(NOT_A_LAYER)
    bound = _bound(node)
    groups = bound.get("groups", 1)
    if type(groups) is not int or groups < 1:
        return Declined(GROUPS_NOT_CONSTANT)
    transposed = bound.get("transposed", op in _CONV_TRANSPOSES)
    if not isinstance(transposed, bool):
        return Declined(TRANSPOSED_NOT_CONSTANT)
    return ConvArguments(
        node=node,
        input=bound["input"],
        weight=bound["weight"],
        bias=bound.get("bias"),
        linear=op in _LINEARS,
        transposed=transposed,
        groups=groups,
        stride=_ints(bound.get("stride", ())),
        padding=_ints(bound.get("padding", ())),
        dilation=_ints(bound.get("dilation", ())),
        output_padding=_ints(bound.get("output_padding", ())),
    )


def set_conv_argument(node: Node, name: str, value: object) -> None:
    """Pass `value` as the conv's (or linear's) argument `name` by position, in the form
    torch's export gives a call: arguments before it that the call left out are filled
    with their schema defaults, ones it passed by keyword move to their positions. The
    PT2E quantizer cannot annotate a tensor passed by keyword (it asserts)."""
    schema_arguments = underlying_op(node.target)._schema.arguments
    index = [a.name for a in schema_arguments].index(name)
    args, kwargs = list(node.args), dict(node.kwargs)
    for argument in schema_arguments[len(args) : index]:
        if argument.name in kwargs:
            args.append(kwargs.pop(argument.name))
        elif argument.has_default_value():
            args.append(argument.default_value)
        else:
            raise ValueError(f"{node.target}: required argument {argument.name!r} is missing")
    if schema_arguments[index].kwarg_only:
        raise ValueError(f"{node.target}: argument {name!r} is keyword-only")
    args[index : index + 1] = [value]
    kwargs.pop(name, None)
    node.args, node.kwargs = tuple(args), kwargs
