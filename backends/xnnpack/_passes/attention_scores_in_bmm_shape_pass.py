# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Keep attention's scores in the batched-matmul shape between its two matmuls.

Given:   s = view(bmm(q, k), [B, H, t, u])          bmm(q, k): [B*H, t, u]
         p = f(s)                                   f: `+ m`, `* c`, `/ c`, a softmax
                                                       over the last dim, expands to
                                                       the same shape, and the safe
                                                       softmax's guard (below)
         o = bmm(view(p, [B*H, t, u]), v)
Result:  p' = f'(bmm(q, k))                         f' reads each 4-D mask m viewed
         o = bmm(p', v)                                without its leading 1

The guard is what SDPA writes when a mask may hide a whole row:
         g = where(logical_not(any(logical_not(eq(s + m, -inf)), -1, keepdim)),
                   full_like(softmax(s + m), 0), softmax(s + m))

A view that splits the leading dim into [B, H] (or merges them back) keeps the
elements of each [t, u] matrix in place: matrix i of the bmm is matrix (i // H, i %
H) of s. Every op of f is elementwise, normalizes along the last dim, or reduces it
keeping it as 1, so on the [B*H, t, u] tensors it computes the same values, matrix
for matrix, provided every operand it reads from outside f takes the same value for
each matrix: a mask broadcast over B and H (dims 0 and 1 are 1 or absent, checked),
which a view dropping its leading 1 makes 3-D with a leading 1, broadcast over B*H;
every value of f is 4-D with the leading [B, H] (checked). Why: torch's SDPA
decomposition writes these views, and on a dynamic sequence each holds the sequence
size twice (t and u), so XNNPACK's reshape, which infers one size, takes neither:
each attention layer splits into three delegates around them. Only then is it
rewritten: a static program keeps its views, which XNNPACK delegates.

f is the region between the views: every op reached from `s` before the view
back. Declines: a view whose sizes XNNPACK's reshape takes (nothing to gain), an
op of the region outside f's set, the scores leaving through other than one view
back, a value of f not 4-D with the view's leading [B, H], an op of f reading a
value from outside it other than as a mask broadcast over B and H, no softmax.
Runs on the ATen program, before decomposition; a program holding an SDPA is
decomposed first with the lowering's table.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from etfold.backends.xnnpack._passes.decomposed_first import decomposed_for
from etfold.decisions import Declined, record_applied
from etfold.exir.passes.graph_walk import sizes_known_equal, symbolic_axes
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import (
    argument_values,
    is_last_axis,
    node_value,
    shapes_known_equal,
)

FOLD = "xnnpack.attention_scores_in_bmm_shape"

aten = torch.ops.aten
VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
ELEMENTWISE = frozenset(
    {aten.add.Tensor, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}
)
# the safe softmax's guard: each reads region values only, besides scalars
GUARD = frozenset(
    {
        aten.eq.Scalar,
        aten.logical_not.default,
        aten.any.dim,
        aten.full_like.default,
        aten.where.self,
    }
)
SCORES_RANK = 4  # the region reads view(bmm, [1, H, t, u])


@dataclass(frozen=True)
class ScoresChain:
    lifted: Node  # view(bmm, [B, H, t, u])
    chain: tuple[Node, ...]  # the region's ops between the views, in graph order
    lowered: Node  # view(the region's last value, [B*H, t, u])
    dropped: frozenset[Node]  # the region's same-shape expands


def splits_leading_dim(view: Node) -> bool:
    """`view` gives its 3-D input's shape with the leading dim split in two, [B, H]."""
    source, value = node_value(view.args[0]), node_value(view)
    if source is None or value is None or source.dim() != 3 or value.dim() != 4:
        return False
    return sizes_known_equal(value.shape[0] * value.shape[1], source.shape[0]) and (
        shapes_known_equal(value.shape[2:], source.shape[1:])
    )


def _is_identity_expand(node: Node) -> bool:
    """An expand to its input's own shape (SDPA writes one before the second matmul)."""
    if node.target is not aten.expand.default:
        return False
    return shapes_known_equal(node_value(node).shape, node_value(node.args[0]).shape)


def _is_mask(operand: object) -> bool:
    """A second operand an elementwise op of f may read from outside it: a number, or a
    tensor broadcast over B and H (its dims aligned to the scores' 0 and 1 are 1)."""
    if not isinstance(operand, Node):
        return isinstance(operand, (int, float))
    mask = node_value(operand)
    if mask is None or mask.dim() > 4:
        return False
    leading = mask.shape[: max(0, mask.dim() - 2)]
    return all(sizes_known_equal(size, 1) for size in leading)


def _region_op(node: Node) -> bool:
    """`node`'s op is one f may hold (what it reads is checked on the whole region)."""
    if node.op != "call_function":
        return False
    if _is_identity_expand(node) or node.target in ELEMENTWISE or node.target in GUARD:
        if node.target is aten.any.dim:
            return (
                len(node.args) == 3
                and is_last_axis(node.args[1], SCORES_RANK)
                and node.args[2] is True
            )
        return True
    return node.target is aten._softmax.default and is_last_axis(node.args[1], SCORES_RANK)


def _outside_inputs(node: Node, inside: set[Node]) -> list[Node]:
    """The values `node` reads from outside `inside`, its elementwise mask aside."""
    reads = [a for a in node.args if isinstance(a, Node)]
    if node.target in ELEMENTWISE and len(node.args) > 1 and node.args[1] not in inside:
        if not _is_mask(node.args[1]):
            return [node.args[1]]
        reads = [node.args[0]]
    return [read for read in reads if read not in inside]


def _the_region(lifted: Node) -> tuple[list[Node], Node] | Declined:
    """Every op reached from `lifted` before the view back, in graph order, and that view."""
    region: set[Node] = set()
    views: list[Node] = []
    frontier = [lifted]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in region or user in views:
                continue
            if user.target in VIEWS:
                views.append(user)
            elif not _region_op(user):
                return Declined(
                    f"`{user.name}` ({user.target}) is not an elementwise op, a softmax "
                    "or its guard"
                )
            else:
                region.add(user)
                frontier.append(user)
    if len(views) != 1 or views[0].args[0] not in region:
        return Declined(f"the scores leave through {len(views)} views, not one view back of f")
    heads = node_value(lifted).shape[:2]
    for node in region:
        value = node_value(node)
        if value is None or value.dim() != 4 or not shapes_known_equal(value.shape[:2], heads):
            return Declined(f"`{node.name}` is not 4-D with the leading {list(heads)}")
        if outside := _outside_inputs(node, region | {lifted}):
            return Declined(
                f"`{node.name}` reads `{outside[0].name}` from outside f, not as a mask "
                "broadcast over B and H"
            )
    (lowered,) = views
    order = {node: index for index, node in enumerate(lifted.graph.nodes)}
    return sorted(region, key=order.__getitem__), lowered


def match_scores_chain(node: Node) -> ScoresChain | Declined | None:
    """The region anchored at `node`, a view lifting a bmm's scores, or why it stays."""
    if node.op != "call_function" or node.target not in VIEWS:
        return None
    source = node.args[0]
    if not (
        isinstance(source, Node) and source.target is aten.bmm.default and splits_leading_dim(node)
    ):
        return None
    if len(symbolic_axes(node_value(node))) < 2:
        return None  # XNNPACK's reshape takes it: nothing to gain
    found = _the_region(node)
    if isinstance(found, Declined):
        return found
    chain, lowered = found
    if not any(op.target is aten._softmax.default for op in chain):
        return Declined("the scores reach the view back without a softmax")
    if not shapes_known_equal(node_value(lowered).shape, node_value(source).shape):
        return Declined("the view back does not give the scores' bmm shape")
    dropped = frozenset(op for op in chain if _is_identity_expand(op))
    return ScoresChain(node, tuple(chain), lowered, dropped)


def _squeezed(graph, anchor: Node, mask: Node) -> Node:
    """`mask` without its leading 1, as a view: where XNNPACK cannot take it (two
    symbolic sizes), ExecuTorch runs a view as an alias of its input, where a squeeze
    would copy."""
    value = node_value(mask)
    with graph.inserting_before(anchor):
        sizes: list[object] = []
        for dim, size in enumerate(value.shape[1:], start=1):
            if type(size) is int:
                sizes.append(size)
                continue
            read = graph.call_function(aten.sym_size.int, (mask, dim))
            read.meta["val"] = size
            sizes.append(read)
        squeezed = graph.call_function(aten.view.default, (mask, sizes))
    squeezed.meta = {**mask.meta, "val": value.squeeze(0)}
    return squeezed


def rewrite_scores_chain(match: ScoresChain) -> None:
    """The region reads the bmm; 4-D masks read squeezed; last dims become -1; the
    views and same-shape expands go."""
    graph, bmm = match.lifted.graph, match.lifted.args[0]
    inside = set(match.chain)
    match.lifted.replace_all_uses_with(bmm)
    for node in match.chain:
        if node in match.dropped:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            continue
        args = list(node.args)
        mask = args[1] if node.target in ELEMENTWISE else None
        if isinstance(mask, Node) and mask not in inside and node_value(mask).dim() == 4:
            args[1] = _squeezed(graph, node, mask)
        if node.target in (aten._softmax.default, aten.any.dim):
            args[1] = -1
        node.args = tuple(args)
        node.meta["val"] = node.target(*argument_values(args), **node.kwargs)
    match.lowered.replace_all_uses_with(match.lowered.args[0])
    graph.erase_node(match.lowered)
    graph.erase_node(match.lifted)
    record_applied(FOLD, match.lifted.name, f"{len(match.chain)} ops on `{bmm.name}`'s shape")


def _writes_sdpa(node: Node) -> bool:
    return node.target is aten.scaled_dot_product_attention.default


def attention_scores_in_bmm_shape(
    program: ExportedProgram, decomposition_table: Mapping | None
) -> ExportedProgram:
    """`program`, or a rewritten copy (decomposed first when it holds an SDPA)."""
    candidate = decomposed_for(program, decomposition_table, _writes_sdpa)
    rewritten = rewrite_matches_on_a_copy(
        candidate, functools.partial(match_scores_chain), rewrite_scores_chain, FOLD
    )
    return program if rewritten is candidate else rewritten
