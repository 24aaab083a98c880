# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Write an expand, which XNNPACK refuses, as the ops it delegates (or as nothing).

Given:   e = expand(x, S)                x: [s0, ..., s(k-1)], S: [S0, ..., S(r-1)]
         l = view(x, [1] * (r - k) + [s0, ..., s(k-1)])    (x itself when r == k)
Result, by what reads e:
  (a) every reader broadcasts:  op(e, y) -> op(l, y)       op: add, sub, mul, div, maximum,
                                                           minimum; when the broadcast shape
                                                           of l and y is the one of e and y
  (b) otherwise:                e -> cat([l, ..., l], i) along each axis i where l has 1 and
                                     S has S_i > 1 (S_i copies), one axis after the other
  (c) S is x's shape:           e -> x
And  cat([x, x, ..., x], i)  (n times, rotary's `cat((freqs, freqs), -1)`) -> the n copies
of (b) along axis i: upstream's cat config counts distinct inputs and refuses it.

(a) An expand is a broadcast: element j of e is element j' of l, j' = j with every
index on an axis of size 1 set to 0. A broadcasting op reads its operands the same
way, so reading l instead of e gives each output element from the same values,
provided the output shape does not change (it would when e alone sets an axis:
`mul(e, 2.0)` or `add(e, y)` where y has 1 there: declined to (b)).
(b) Concatenating S_i copies of a size-1 slab along axis i gives a slab whose every
index on axis i holds the one value: the expand along axis i. Every form only copies
values, so each is bit-exact in every dtype.

Why. ExecuTorch 1.5.1's XNNPACK partitioner has no config for `expand_copy`, so every
expand stays on portable kernels and cuts the delegate: grouped-query attention's
`repeat_kv` (expand along an inserted axis, then a reshape), attention masks
broadcast to `[B, H, T, T]`, and the batch expands `matmul`'s decomposition writes
(no-ops, `(c)`). Upstream delegates the binary ops, `cat` and a static `view_copy`.

XNNPACK's concatenate takes 2 to 5 inputs, and upstream's CatConfig counts distinct
input nodes: each cat here takes at most 5, the first one a view of l beside l.

Symbolic sizes. A dynamic dim (`torch.export.Dim`) the expand keeps is fine: the
binary ops, `cat` and a view with one inferred size all resize at runtime, so
GQA's repeat_kv and a `[1, 1, T, T]` mask on a dynamic T are rewritten. Equal
sizes are equal for every value within the export's bounds (the shape
environment decides, never a guess). What stays: copies along a dim whose count
is symbolic (concatenate's inputs are fixed when lowering), and a view of an
input with two symbolic sizes (XNNPACK's reshape infers one); each decline names
the dim and its bounds.

Declines (the expand stays): those, an empty result, a quantized input, a rank
beyond XNNPACK's, for (b) a dtype XNNPACK does not concatenate here, and for (c) an
expand the program returns (it would return its input as a second output).

Runs on the ATen program, before decomposition; a program holding a batched
`matmul` (or an attention, which writes such matmuls) is decomposed with the
lowering's own table first (what upstream does next anyway), so the expands it
writes are seen; nothing rewritten, it comes back as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from etfold.backends.xnnpack._passes.decomposed_first import decomposed_for
from etfold.backends.xnnpack._passes.delegated_floats import (
    delegated_floats,
    dtype_taken,
    not_quantized,
    rank_held,
)
from etfold.decisions import Declined, first_declined, record_applied
from etfold.exir.passes.graph_walk import (
    describe_axes,
    size_bounds,
    sizes_known_equal,
    symbolic_axes,
)
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import argument_values, axis_index, node_value, rank_of

FOLD = "xnnpack.expand_as_delegated_ops"

aten = torch.ops.aten
# upstream config target of each ATen binary op whose XNNPACK node broadcasts both operands
BROADCASTING_OPS = {
    aten.add.Tensor: "add.Tensor",
    aten.sub.Tensor: "sub.Tensor",
    aten.mul.Tensor: "mul.Tensor",
    aten.div.Tensor: "div.Tensor",
    aten.maximum.default: "maximum.default",
    aten.minimum.default: "minimum.default",
}
# the upstream configs the copies need: the lift and the first copy are views
COPY_TARGETS = ("cat.default", "view_copy.default")
MAX_CAT_INPUTS = 5  # XNNPACK's concatenate nodes take 2 to 5 inputs


@dataclass(frozen=True)
class ExpandAsDelegatedOps:
    node: torch.fx.Node
    lifted: tuple | None  # x's sizes at e's rank (ints or symbolic), when the expand adds axes
    repeats: tuple[tuple[int, int], ...]  # (axis, copies) concatenated; () when dropped


def _shapes(node: torch.fx.Node) -> tuple[tuple, tuple] | Declined:
    """The input's and the result's sizes (ints or symbolic), when no result is empty."""
    source, out = node_value(node.args[0]).shape, node_value(node).shape
    if any(type(size) is int and size == 0 for size in out):
        return Declined(f"empty result {list(out)}: XNNPACK takes no empty tensors")
    return tuple(source), tuple(out)


def copies_known(lifted: tuple, out: tuple) -> Declined | None:
    """Every axis is either kept (its size provably the input's) or copied a static
    number of times from a size-1 input axis: concatenate's inputs are fixed when lowering."""
    for axis, (m, n) in enumerate(zip(lifted, out, strict=True)):
        if sizes_known_equal(m, n):
            continue
        if type(n) is not int or type(m) is not int or m != 1:
            symbolic = n if type(n) is not int else m
            low, high = size_bounds(symbolic)
            return Declined(
                f"dynamic shape: dim {axis} goes from {m} to {n} ({symbolic} in {low}..{high}): "
                "the copies are not known when lowering"
            )
    return None


def views_infer_the_rest(value: torch.Tensor, what: str) -> Declined | None:
    """A view of `value` can be written: at most one symbolic size, inferred at runtime."""
    symbolic = symbolic_axes(value)
    if len(symbolic) > 1:
        return Declined(
            f"{what} has symbolic sizes at {describe_axes(value, symbolic)}: XNNPACK's "
            "static reshape infers at most one"
        )
    return None


def view_sizes(sizes: tuple) -> list[int]:
    """A view's size argument: the one symbolic size becomes the inferred -1."""
    return [size if type(size) is int else -1 for size in sizes]


def _operand_shape(value: object, node: torch.fx.Node, lifted: tuple) -> tuple:
    if value is node:
        return lifted
    return tuple(node_value(value).shape) if isinstance(value, torch.fx.Node) else ()


def _same_sizes(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(map(sizes_known_equal, a, b))


def broadcasts_alike(
    node: torch.fx.Node, lifted: tuple, broadcasting: Collection
) -> Declined | None:
    """None when every reader is a broadcasting op whose result keeps its shape with
    the expand's input (viewed to its rank) in its place, for every size within the
    export's bounds; else why it is kept."""
    for user in node.users:
        if user.target not in broadcasting or node in user.kwargs.values():
            return Declined(f"read by {user.name}, which does not broadcast it")
        if not isinstance(node_value(user), torch.Tensor):
            return Declined(f"no tensor metadata on {user.name}")
        shapes = [_operand_shape(a, node, lifted) for a in user.args[:2]]
        try:
            broadcast = tuple(torch.broadcast_shapes(*shapes))
        except (RuntimeError, ValueError):  # a symbolic size it cannot decide on
            return Declined(f"the broadcast at {user.name} is not known when lowering")
        if not _same_sizes(broadcast, tuple(node_value(user).shape)):
            return Declined(f"the expand sets {user.name}'s shape on its own")
    return None


def not_returned(node: torch.fx.Node) -> Declined | None:
    if any(user.op == "output" for user in node.users):
        return Declined("a no-op the program returns: removed, it would return its input")
    return None


def match_expand(
    node: torch.fx.Node, dtypes: Collection[torch.dtype], broadcasting: Collection
) -> ExpandAsDelegatedOps | Declined | None:
    """The rewrite of `node`, a reason it stays, or None when it is not an expand."""
    if node.op != "call_function" or node.target is not aten.expand.default:
        return None
    source = node.args[0]
    if rank_of(source) is None:
        return Declined("no tensor metadata on the expand's input")
    shapes = _shapes(node)
    if isinstance(shapes, Declined):
        return shapes
    shape, out = shapes
    lifted = (1,) * (len(out) - len(shape)) + shape
    declined = first_declined(
        lambda: rank_held(len(out), "result"),
        lambda: not_quantized(source, "the copies would each need quantization"),
    )
    if declined is not None:
        return declined
    view = lifted if len(lifted) != len(shape) else None
    repeats = tuple(
        (axis, n)
        for axis, (m, n) in enumerate(zip(lifted, out, strict=True))
        if not sizes_known_equal(m, n)
    )
    if not repeats and view is None and (declined := not_returned(node)) is not None:
        return declined
    if view is not None and (declined := views_infer_the_rest(node_value(source), "the input")):
        return declined
    if not repeats or broadcasts_alike(node, lifted, broadcasting) is None:
        return ExpandAsDelegatedOps(node, view, ())
    declined = first_declined(
        lambda: copies_known(lifted, out),
        lambda: dtype_taken(node_value(source), dtypes, "copy along an axis"),
        lambda: views_infer_the_rest(node_value(source), "the copied input"),
    )
    return declined if declined is not None else ExpandAsDelegatedOps(node, view, repeats)


def _insert(anchor: torch.fx.Node, target, *args) -> torch.fx.Node:
    """`target(*args)` before `anchor`, with `anchor`'s metadata and its own value."""
    with anchor.graph.inserting_before(anchor):
        node = anchor.graph.call_function(target, args)
    node.meta = {**anchor.meta, "val": target(*argument_values(args))}
    return node


def _cat_copies(anchor: torch.fx.Node, value: torch.fx.Node, axis: int, copies: int):
    """`copies` copies of `value` along `axis`; each cat takes 2 to 5 distinct-enough
    inputs (a view of `value` beside it in the first, the previous cat in later ones)."""
    alias = _insert(anchor, aten.view.default, value, view_sizes(node_value(value).shape))
    pieces = [value, alias, *[value] * (copies - 2)]
    while len(pieces) > MAX_CAT_INPUTS:
        head = _insert(anchor, aten.cat.default, pieces[:MAX_CAT_INPUTS], axis)
        pieces = [head, *pieces[MAX_CAT_INPUTS:]]
    return _insert(anchor, aten.cat.default, pieces, axis)


def _detail(match: ExpandAsDelegatedOps) -> str:
    if match.repeats:
        return ", ".join(f"{n} copies along axis {axis}" for axis, n in match.repeats)
    source = match.lifted or tuple(node_value(match.node.args[0]).shape)
    if not _same_sizes(source, tuple(node_value(match.node).shape)):
        readers = ", ".join(user.name for user in match.node.users)
        return f"dropped: {readers} broadcast its input"
    return "a no-op: its input is read instead" if match.lifted is None else "a view adding axes"


def rewrite_expand(match: ExpandAsDelegatedOps) -> None:
    """The expand becomes the (lifted) input, concatenated along each repeated axis."""
    node = match.node
    detail, value = _detail(match), node.args[0]
    if match.lifted is not None:
        value = _insert(node, aten.view.default, value, view_sizes(match.lifted))
    for axis, copies in match.repeats:
        value = _cat_copies(node, value, axis, copies)
    node.replace_all_uses_with(value)
    node.graph.erase_node(node)
    record_applied(FOLD, node.name, detail)


@dataclass(frozen=True)
class CatOfOneInput:
    """`cat([x, x, ...], axis)`: copies of one input, which upstream's cat config refuses
    (it counts distinct inputs); written as the copies (b) writes."""

    node: torch.fx.Node
    axis: int
    copies: int


def match_cat_of_one_input(
    node: torch.fx.Node, dtypes: Collection[torch.dtype]
) -> CatOfOneInput | Declined | None:
    """The rewrite of a cat whose inputs are all one node, a reason it stays, or None."""
    if node.op != "call_function" or node.target is not aten.cat.default:
        return None
    tensors = node.args[0]
    if len(tensors) < 2 or len(set(tensors)) != 1:
        return None
    source = tensors[0]
    if rank_of(source) is None or rank_of(source) == 0:
        return Declined("no tensor metadata on the concatenated input")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    value = node_value(source)
    declined = first_declined(
        lambda: rank_held(value.dim(), "input"),
        lambda: not_quantized(source, "the copies would each need quantization"),
        lambda: dtype_taken(value, dtypes, "copy along an axis"),
        lambda: views_infer_the_rest(value, "the concatenated input"),
    )
    return (
        declined
        if declined is not None
        else CatOfOneInput(node, axis_index(dim, value.dim()), len(tensors))
    )


def rewrite_cat_of_one_input(match: CatOfOneInput) -> None:
    node = match.node
    value = _cat_copies(node, node.args[0][0], match.axis, match.copies)
    node.replace_all_uses_with(value)
    node.graph.erase_node(node)
    record_applied(FOLD, node.name, f"one input, {match.copies} copies along axis {match.axis}")


def _match_copies(node: torch.fx.Node, dtypes, broadcasting):
    if node.op == "call_function" and node.target is aten.cat.default:
        return match_cat_of_one_input(node, dtypes)
    return match_expand(node, dtypes, broadcasting)


def _rewrite_copies(match: ExpandAsDelegatedOps | CatOfOneInput) -> None:
    if isinstance(match, CatOfOneInput):
        rewrite_cat_of_one_input(match)
    else:
        rewrite_expand(match)


def _makes_expands(node: torch.fx.Node) -> bool:
    """A matmul whose decomposition batches an operand with `expand` (both ranks >= 2,
    one >= 3), or an attention, whose decomposition writes such matmuls."""
    if node.op != "call_function":
        return False
    if node.target is aten.scaled_dot_product_attention.default:
        return True
    if node.target is not aten.matmul.default:
        return False
    ranks = [rank_of(a) or 0 for a in node.args[:2]]
    return min(ranks) >= 2 and max(ranks) >= 3


def expands_as_delegated_ops(
    program: ExportedProgram,
    decomposition_table: Mapping | None,
    broadcasting: Collection,
    *,
    bf16: bool,
) -> ExportedProgram:
    """`program`, or a rewritten copy (decomposed first where a matmul writes expands)
    when some expand is rewritten. `broadcasting`: the ATen binary ops XNNPACK takes
    here; `bf16`: whether XNNPACK concatenates bf16 here."""
    match = functools.partial(
        _match_copies, dtypes=delegated_floats(bf16), broadcasting=frozenset(broadcasting)
    )
    candidate = decomposed_for(program, decomposition_table, _makes_expands)
    rewritten = rewrite_matches_on_a_copy(candidate, match, _rewrite_copies, FOLD)
    return program if rewritten is candidate else rewritten
