# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Write squeezes, unsqueezes and symbolic views that XNNPACK would refuse as views it takes.

    unsqueeze(x, d)   -> view(x, shape(x)[:d] + [1] + shape(x)[d:])
    squeeze(x, dims)  -> view(x, [shape(x)[i] for i not in dims or shape(x)[i] != 1])
    view(x, [.., s, ..]) -> view(x, [.., -1, ..])       s: a symbolic size (a dynamic dim)

Each side is the same function of any tensor (inserting or dropping a size-1
dim is a view of every strided layout), and the new shape is the op's own output
shape, read from its metadata; its one symbolic size becomes view's inferred
`-1`, which is that size: numel(x) divided by the product of the static sizes.
Upstream delegates an unsqueeze only on the trailing dim (its visitor's limit)
and no squeeze at all; it delegates a `view_copy` only when every size argument
is an int, so a dynamic export's reshapes (`x.view(b, t, heads, d)` with `t`
dynamic) all stay outside. XNNPACK's static reshape infers one size at runtime
(its 0, which the visitor writes for `-1`): an output with two symbolic sizes
is declined, naming them.

Layout: inside a delegate, XNNPACK's ChannelsLastTaggedReshapePass gives every
`view_copy` NCHW inputs (transposing an NHWC producer back first) and tags its
output NCHW, as it does for squeeze and unsqueeze, so the static reshape always
sees the logical, contiguous order: the view is exact whether its neighbours run
channels-last (a convolution) or contiguous. (That pass pins no layout for
`squeeze_copy.dims`, what `squeeze(d)` lowers to: a visitor for it would reshape
NHWC data. Going through `view_copy` avoids that.)

Runs on the ATen program, before decomposition. A rewritten node is marked
(`meta["custom"][SHAPE_OP_MARK]`, which survives decomposition) so the
partitioner can report, and drop, a view that would sit in a delegate alone.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from etfold.backends.xnnpack._passes.delegated_floats import (
    XNN_MAX_TENSOR_DIMS,
    delegated_floats,
    dtype_taken,
)
from etfold.decisions import Declined
from etfold.exir.passes.graph_walk import (
    describe_axes,
    op_qualified_name,
    symbolic_axes,
    written_arguments,
)
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import is_last_axis, node_value

FOLD = "xnnpack.shape_op_as_view"
SHAPE_OP_MARK = "etfold_shape_op_as_view"

aten = torch.ops.aten
_SQUEEZES = frozenset({aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default})
_SHAPE_OPS = _SQUEEZES | {aten.unsqueeze.default}
# views whose size argument may hold symbolic sizes (`_unsafe_view`: matmul's decomposition)
_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
_FLATTENS = frozenset({aten.flatten.using_ints, aten.unflatten.int})
# ATen ops that reach a delegated edge op under another name after decomposition
_DECOMPOSES_TO_DELEGATED = frozenset(
    {
        "conv1d.default",
        "conv1d.padding",
        "conv2d.default",
        "conv2d.padding",
        "conv_transpose1d.default",
        "conv_transpose2d.input",
        "matmul.default",
        "scaled_dot_product_attention.default",
        "softmax.int",
        "to.dtype",
    }
)


@dataclass(frozen=True)
class ShapeOpAsView:
    node: torch.fx.Node
    shape: tuple[int, ...]  # the view's size argument, -1 for the one symbolic size


def is_upstream_delegated(node: torch.fx.Node) -> bool:
    """An unsqueeze on the trailing dim: upstream's own config and visitor take it."""
    if node.target != aten.unsqueeze.default:
        return False
    return is_last_axis(node.args[1], node_value(node.args[0]).dim() + 1)


def delegated_op_names(config_targets: Collection[str]) -> frozenset[str]:
    """`add.Tensor`-style names of the ATen ops whose edge form some config takes."""
    return frozenset(config_targets) | _DECOMPOSES_TO_DELEGATED


def _op_name(node: torch.fx.Node) -> str:
    return op_qualified_name(node.target).removeprefix("aten.")


def _goes_to_xnnpack(node: torch.fx.Node, delegated: frozenset[str]) -> bool:
    """By name: `view.default` is delegated as `view_copy.default`."""
    name = _op_name(node)
    return name in delegated or name.replace(".", "_copy.", 1) in delegated


def beside_delegated_op(node: torch.fx.Node, delegated: frozenset[str]) -> bool:
    """Some op next to `node`, or next to the chain of squeezes/unsqueezes it is in,
    is one that XNNPACK takes."""
    seen, stack = {node}, [node]
    while stack:
        current = stack.pop()
        for n in (current.args[0], *current.users):
            if n in seen or n.op != "call_function":
                continue
            seen.add(n)
            if n.target in _SHAPE_OPS:
                stack.append(n)
            elif _goes_to_xnnpack(n, delegated):
                return True
    return False


def view_shape(value: torch.Tensor) -> tuple[int, ...] | Declined:
    symbolic = symbolic_axes(value)
    if len(symbolic) > 1:
        return Declined(
            f"sizes {list(symbolic)} are symbolic ({describe_axes(value, symbolic)}): "
            "XNNPACK's static reshape infers at most one"
        )
    return tuple(-1 if i in symbolic else size for i, size in enumerate(value.shape))


def _contiguous(value: torch.Tensor) -> bool:
    """Contiguous for every size within the export's bounds (a view of it is exact)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(value.is_contiguous()))


def _written_in_place(node: torch.fx.Node) -> bool:
    """A user writes into it (a view passes writes to its base, a copy would not)."""
    return any(node in written_arguments(user) for user in node.users)


def has_symbolic_size_argument(node: torch.fx.Node) -> bool:
    """A view whose size argument holds something other than ints (a symbolic size), or a
    flatten / unflatten of a dynamic shape (decomposed, it is such a view)."""
    if node.target in _FLATTENS:
        return bool(symbolic_axes(node_value(node)))
    return node.target in _VIEWS and not all(type(size) is int for size in node.args[1])


def _ours_to_judge(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    return node.target in _SHAPE_OPS or has_symbolic_size_argument(node)


def match_shape_op(
    node: torch.fx.Node, delegated: frozenset[str], dtypes: Collection[torch.dtype]
) -> ShapeOpAsView | Declined | None:
    """The view `node` becomes, a reason it stays, or None when it is not ours to judge."""
    if not _ours_to_judge(node):
        return None
    source, value = node.args[0], node_value(node)
    if not isinstance(value, torch.Tensor) or not isinstance(node_value(source), torch.Tensor):
        return Declined("no tensor metadata on the op or its input")
    if is_upstream_delegated(node):
        return None
    if (declined := dtype_taken(value, dtypes, "tensor")) is not None:
        return declined
    ranks = (node_value(source).dim(), value.dim())
    if max(ranks) > XNN_MAX_TENSOR_DIMS or min(ranks) == 0:
        return Declined(
            f"rank {ranks[0]} -> {ranks[1]}: XNNPACK tensors have 1 to {XNN_MAX_TENSOR_DIMS} dims"
        )
    if node.target in _FLATTENS and not _contiguous(node_value(source)):
        return Declined("flattens a non-contiguous tensor: a copy, not a view")
    if _written_in_place(node):
        return Declined("a user writes into it in place")
    if node.target in _SHAPE_OPS and not beside_delegated_op(node, delegated):
        return Declined("no op beside it goes to XNNPACK: a delegate holding only a reshape")
    shape = view_shape(value)
    return shape if isinstance(shape, Declined) else ShapeOpAsView(node, shape)


def _argument_text(argument: object) -> object:
    """A size argument as it reads: a symbolic size by its node's value, not its name."""
    if isinstance(argument, (list, tuple)):
        return [_argument_text(a) for a in argument]
    if not isinstance(argument, torch.fx.Node):
        return argument
    value = node_value(argument)
    return argument.name if value is None else value


def drop_unread_size_computations(nodes: list[torch.fx.Node]) -> None:
    """The symbolic-size computations (`sym_size`, arithmetic on it) nothing reads now."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node.users or node.op != "call_function" or isinstance(node_value(node), torch.Tensor):
            continue
        stack.extend(node.all_input_nodes)
        node.graph.erase_node(node)


def rewrite_as_view(match: ShapeOpAsView) -> None:
    node = match.node
    original = f"{_op_name(node)}{tuple(map(_argument_text, node.args[1:]))}"
    sizes_read = [a for a in node.all_input_nodes if a is not node.args[0]]
    node.target = aten.view.default
    node.args = (node.args[0], list(match.shape))
    node.kwargs = {}
    drop_unread_size_computations(sizes_read)
    node.meta["custom"] = {**node.meta.get("custom", {}), SHAPE_OP_MARK: original}


def shape_ops_as_views(
    program: ExportedProgram, delegated: frozenset[str], *, bf16: bool
) -> ExportedProgram:
    """`program`, or a rewritten copy when some squeeze or unsqueeze becomes a view."""
    match = functools.partial(match_shape_op, delegated=delegated, dtypes=delegated_floats(bf16))
    return rewrite_matches_on_a_copy(program, match, rewrite_as_view, FOLD)
