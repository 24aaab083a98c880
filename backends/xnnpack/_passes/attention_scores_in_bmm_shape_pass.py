# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Keep attention's scores in the batched-matmul shape between its two matmuls.

Given:   s = view(bmm(q, k), [1, H, t, u])          bmm(q, k): [H, t, u]
         p = f(s)                                   f: a chain of `+ m`, `* c`, `/ c`,
                                                       a softmax over the last dim, and
                                                       expands to the same shape
         o = bmm(view(p, [H, t, u]), v)
Result:  p' = f'(bmm(q, k))                         f' reads m squeezed of its leading 1
         o = bmm(p', v)

A view that prepends or drops a leading 1 moves no data, and every op of the
chain is elementwise or normalizes along the last dim, so computing it on the
[H, t, u] tensor gives the same values; a mask of rank 4 broadcast over `[1, H,
t, u]` has a leading 1 (or the chain would be 4-D past its first dim), which a
squeeze drops. Why: torch's SDPA decomposition writes these views, and on a
dynamic sequence each holds the sequence size twice (t and u), so XNNPACK's
reshape, which infers one size, takes neither: each attention layer splits
into three delegates around them. Only then is it rewritten: a static program
keeps its views, which XNNPACK delegates.

Declines: a view whose sizes XNNPACK's reshape takes (nothing to gain), a chain
op read elsewhere, an op outside the chain's set. Runs on the ATen program,
before decomposition; a program holding an SDPA is decomposed first with the
lowering's table.
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

FOLD = "xnnpack.attention_scores_in_bmm_shape"

aten = torch.ops.aten
VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
ELEMENTWISE = frozenset(
    {aten.add.Tensor, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}
)


@dataclass(frozen=True)
class ScoresChain:
    lifted: Node  # view(bmm, [1, H, t, u])
    chain: tuple[Node, ...]  # the elementwise ops, the softmax and same-shape expands, in order
    lowered: Node  # view(chain[-1], [H, t, u])
    dropped: frozenset[Node]  # the chain's same-shape expands


def _value(node: object):
    return node.meta.get("val") if isinstance(node, Node) else None


def _same_shape(a, b) -> bool:
    return len(a) == len(b) and all(sizes_known_equal(x, y) for x, y in zip(a, b, strict=True))


def _prepends_one(view: Node) -> bool:
    """`view` gives its 3-D input's shape with a leading 1."""
    source, value = _value(view.args[0]), _value(view)
    if source is None or value is None or source.dim() != 3 or value.dim() != 4:
        return False
    return sizes_known_equal(value.shape[0], 1) and _same_shape(value.shape[1:], source.shape)


def _is_identity_expand(node: Node) -> bool:
    """An expand to its input's own shape (SDPA writes one before the second matmul)."""
    if node.target is not aten.expand.default:
        return False
    return _same_shape(_value(node).shape, _value(node.args[0]).shape)


def _chain_op(node: Node) -> bool:
    if _is_identity_expand(node):
        return True
    if node.target is aten._softmax.default:
        return node.args[1] in (-1, 3)
    if node.target not in ELEMENTWISE:
        return False
    other = node.args[1]
    if not isinstance(other, Node):
        return isinstance(other, (int, float))
    mask = _value(other)
    return mask is not None and (mask.dim() < 4 or sizes_known_equal(mask.shape[0], 1))


def _the_chain(lifted: Node) -> tuple[list[Node], Node] | Declined:
    """The chain after `lifted` up to the view back, each op read only by the next."""
    chain, node = [], lifted
    while len(node.users) == 1:
        (user,) = node.users
        if user.target in VIEWS:
            return chain, user
        if user.args[0] is not node or not _chain_op(user):
            return Declined(f"`{user.name}` ({user.target}) is not an elementwise op or softmax")
        chain.append(user)
        node = user
    return Declined(f"`{node.name}` is read by {len(node.users)} ops, not one view back")


def match_scores_chain(node: Node) -> ScoresChain | Declined | None:
    """The chain anchored at `node`, a view lifting a bmm's scores, or why it stays."""
    if node.op != "call_function" or node.target not in VIEWS:
        return None
    source = node.args[0]
    if not (isinstance(source, Node) and source.target is aten.bmm.default and _prepends_one(node)):
        return None
    if len(symbolic_axes(_value(node))) < 2:
        return None  # XNNPACK's reshape takes it: nothing to gain
    found = _the_chain(node)
    if isinstance(found, Declined):
        return found
    chain, lowered = found
    computed = [op for op in chain if not _is_identity_expand(op)]
    if not computed or computed[-1].target is not aten._softmax.default:
        return Declined("the scores reach the view back without a softmax")
    if not _same_shape(_value(lowered).shape, _value(source).shape):
        return Declined("the view back does not give the scores' bmm shape")
    dropped = frozenset(op for op in chain if _is_identity_expand(op))
    return ScoresChain(node, tuple(chain), lowered, dropped)


def _squeezed(graph, anchor: Node, mask: Node) -> Node:
    with graph.inserting_before(anchor):
        squeezed = graph.call_function(aten.squeeze.dim, (mask, 0))
    squeezed.meta = {**mask.meta, "val": _value(mask).squeeze(0)}
    return squeezed


def rewrite_scores_chain(match: ScoresChain) -> None:
    """The chain reads the bmm; 4-D masks read squeezed; the views go."""
    graph, bmm = match.lifted.graph, match.lifted.args[0]
    previous = bmm
    for node in match.chain:
        if node in match.dropped:
            node.replace_all_uses_with(previous)
            graph.erase_node(node)
            continue
        args = list(node.args)
        args[0] = previous
        if isinstance(args[1], Node) and _value(args[1]).dim() == 4:
            args[1] = _squeezed(graph, node, args[1])
        if node.target is aten._softmax.default:
            args[1] = -1
        node.args = tuple(args)
        operands = [_value(a) if isinstance(a, Node) else a for a in args]
        node.meta["val"] = node.target(*operands, **node.kwargs)
        previous = node
    match.lowered.replace_all_uses_with(previous)
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
