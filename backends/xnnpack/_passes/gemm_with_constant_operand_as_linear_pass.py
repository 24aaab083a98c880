# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Write a GEMM whose right operand is a constant, in any layout, as XNNPACK's linear.

Given:   y = matmul(x, B)  or  mm(x, B)                    B: [K, N]
         y = bmm(x, expand(B, [b, K, N]))                   B: [K, N] or [1, K, N]
         y = einsum("...k,nk->...n", x, B), or "kn" for B's subscripts, either order
         B = relayout(W): W a constant (parameter, buffer, lifted constant) read through
         ops that only re-lay its elements out (transpose, permute, view, reshape,
         unsqueeze, a convert to its own dtype): `x @ W.T`, `x @ transpose(E, 0, 1)`
Result:  y = linear(x, V)           V = M^T, [N, K]; M the [K, N] matrix B holds

    matmul(x, transpose(W)) = linear(x, W)        matmul(x, W) = linear(x, W^T)

linear(x, V)[..., n] = sum_k x[..., k] * V[n, k] = sum_k x[..., k] * M[k, n]: the same
products and sums, summed by XNNPACK's GEMM as the mm or bmm it replaces would be
(float32: within 1e-6 relative of eager in the tests). V is W itself when W holds
exactly V and nothing else reads W; otherwise V is a new constant, named from W and
a digest of its values (never written into W), and W leaves the program when
nothing reads it any more.

Why: ATen writes a matmul of a 3-D x as view, mm, view. With a dynamic sequence
those views keep their sizes in ops (`sym_size`, `mul`) XNNPACK does not run; a
linear takes any leading dims and resizes at runtime. And a weight tied to an
embedding (Whisper's logits, `x @ transpose(token_embedding.weight, 0, 1)`) is
read by the embedding outside every delegate: the weight fold would have to add a
transposed copy of the whole table, past its growth budget at any real
vocabulary, so the transpose and the mm stayed outside. Here the linear reads a
copy the delegate owns, and the decision records the bytes it adds (the table is
also in the program for the embedding; stock ExecuTorch duplicates a constant a
delegate shares with an op outside it the same way). Reading W itself there would
also cut the delegate: W would join the linear's partition while the embedding
outside it reads W and feeds the same partition.

Declines: a training program (its parameters stay trainable); W written by the
program, or read by several methods (`source_verdict`);
x of a dtype XNNPACK does not compile the linear in here, or quantized; x or the
result of a rank XNNPACK does not hold. Not judged (left alone): a GEMM of two
runtime values, a constant on the left, a weight computed from constants (the
weight fold's), an x computed from constants alone (constant work, the weight
fold's too), a batched constant operand that is not one matrix broadcast.
Runs on the ATen program, before decomposition.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from etfold.backends.xnnpack._passes.delegated_floats import (
    delegated_floats,
    dtype_taken,
    not_quantized,
    rank_held,
)
from etfold.backends.xnnpack._passes.mask_at_every_size import user_value_readers
from etfold.backends.xnnpack.partition.weight_fold_seeds import is_export_check
from etfold.decisions import Declined, first_declined, record_applied, record_declined
from etfold.exir.passes.constant_prop.evaluate import evaluate
from etfold.exir.passes.constant_prop.verdicts import EVERY_METHOD, source_verdict
from etfold.exir.passes.graph_walk import (
    ConstantSource,
    StateFacts,
    add_lifted_constant,
    constant_holding,
    constant_names,
    drop_unread,
    relayout_root,
    remove_unread_placeholder,
    state_facts,
)
from etfold.exir.passes.inline_autocast_regions_pass import is_training_program
from etfold.exir.passes.node_rewrite_driver import rewrite_matches_on_a_copy
from etfold.exir.passes.node_shapes import node_value

FOLD = "xnnpack.gemm_with_constant_operand_as_linear"

aten = torch.ops.aten


@dataclass(frozen=True)
class Operands:
    """A GEMM's runtime operand, its constant operand (before any broadcast), and whether
    that operand holds V = M^T itself (einsum's "nk") rather than M."""

    x: Node
    constant: Node
    holds_transpose: bool
    broadcast: tuple[Node, ...] = ()  # the expand between the constant and the GEMM


@dataclass(frozen=True)
class GemmAsLinear:
    node: Node
    x: Node
    source: ConstantSource  # W
    chain: tuple[Node, ...]  # W's re-layouts up to the GEMM, root first
    weight: torch.Tensor  # V, [N, K]
    reads_source: bool  # V is W, and W is read by nothing else: the linear reads W


def _einsum_operands(node: Node) -> Operands | None:
    """x and B of `einsum("...k,nk->...n", x, B)` (B's subscripts "nk" or "kn", either
    operand first); None for any other equation."""
    equation, operands = node.args[0], node.args[1]
    if not isinstance(equation, str) or len(operands) != 2:
        return None
    terms, _, output = equation.replace(" ", "").partition("->")
    parts = terms.split(",")
    if len(parts) != 2 or not output:
        return None
    for x_at in (0, 1):
        x_term, w_term = parts[x_at], parts[1 - x_at]
        letters = x_term.removeprefix("...")
        if "." in letters or len(set(letters)) != len(letters) or not letters:
            continue
        k = letters[-1]
        if len(w_term) != 2 or len(set(w_term)) != 2 or k not in w_term:
            continue
        n = w_term.replace(k, "")
        if n not in x_term and output == x_term[:-1] + n:
            return Operands(operands[x_at], operands[1 - x_at], holds_transpose=w_term == n + k)
    return None


def _bmm_operands(node: Node) -> Operands | None:
    """x and B of `bmm(x, expand(B, [b, K, N]))`, or of `bmm(x, B)` with B [1, K, N]."""
    x, operand = node.args[:2]
    broadcast: tuple[Node, ...] = ()
    if isinstance(operand, Node) and operand.target is aten.expand.default:
        broadcast, operand = (operand,), operand.args[0]
    value = node_value(operand)
    if not isinstance(value, torch.Tensor) or value.dim() not in (2, 3):
        return None
    if value.dim() == 3 and value.shape[0] != 1:
        return None
    return Operands(x, operand, holds_transpose=False, broadcast=broadcast)


def gemm_operands(node: Node) -> Operands | None:
    """The runtime and constant operands of a GEMM with its constant on the right."""
    if node.op != "call_function":
        return None
    if node.target in (aten.matmul.default, aten.mm.default):
        x, operand = node.args[:2]
        value = node_value(operand)
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            return None
        return Operands(x, operand, holds_transpose=False)
    if node.target is aten.bmm.default:
        return _bmm_operands(node)
    if node.target is aten.einsum.default:
        return _einsum_operands(node)
    return None


def readers(node: Node) -> list[Node]:
    """What reads `node`'s values: its users but export's checks of its metadata."""
    return [user for user in node.users if not is_export_check(user)]


def _other_readers(source: Node, path: tuple[Node, ...], gemm: Node) -> tuple[str, ...]:
    """Nodes reading W, or what the GEMM reads it through (`path`: its re-layouts and
    broadcast), that are neither on that path nor the GEMM."""
    inside = {*path, gemm}
    found = {user.name for node in (source, *path) for user in readers(node) if user not in inside}
    return tuple(sorted(found))


def matrix_of(operands: Operands, chain: tuple[Node, ...], source: ConstantSource):
    """V = M^T, [N, K], from W's value through the chain; or a Declined."""
    values: dict[Node, object] = {source.node: source.tensor}
    for node in chain:
        value = evaluate(node, values)
        if isinstance(value, Declined):
            return value
        values[node] = value
    held = values[chain[-1]] if chain else source.tensor
    held = held.detach().reshape(held.shape[-2:])
    # a copy of its own: V never shares storage with W or another constant
    return (held if operands.holds_transpose else held.t()).clone(
        memory_format=torch.contiguous_format
    )


def x_taken(x: Node, result: Node, dtypes: Collection[torch.dtype]) -> Declined | None:
    value = node_value(x)
    if not isinstance(value, torch.Tensor) or not isinstance(node_value(result), torch.Tensor):
        return Declined("no tensor metadata on the GEMM or its input")
    return first_declined(
        lambda: dtype_taken(value, dtypes, "linear"),
        lambda: rank_held(value.dim(), "input"),
        lambda: rank_held(node_value(result).dim(), "result"),
        lambda: not_quantized(x, "the linear would need quantization"),
    )


@dataclass(frozen=True)
class ProgramFacts:
    """What matching reads from the whole program, gathered once per program."""

    program: ExportedProgram
    state: StateFacts
    runtime: frozenset[Node]  # the nodes that compute from a user input's values


def program_facts(program: ExportedProgram) -> ProgramFacts:
    return ProgramFacts(program, state_facts(program), frozenset(user_value_readers(program)))


def match_gemm(
    node: Node, facts: ProgramFacts, dtypes: Collection[torch.dtype]
) -> GemmAsLinear | Declined | None:
    """The linear `node` becomes, a reason it stays, or None when it is not ours to judge."""
    operands = gemm_operands(node)
    if operands is None or not isinstance(operands.x, Node):
        return None
    if operands.x not in facts.runtime:
        return None  # constants times constants: the weight fold's to compute when lowering
    root, chain = relayout_root(operands.constant)
    if not isinstance(root, Node) or root.op != "placeholder":
        return None
    source = source_verdict(facts.program, root, EVERY_METHOD, facts.state)
    if not isinstance(source, ConstantSource):
        return source  # None: a runtime operand, not ours; else why W is not a constant
    declined = x_taken(operands.x, node, dtypes)
    if declined is not None:
        return declined
    weight = matrix_of(operands, chain, source)
    if isinstance(weight, Declined):
        return weight
    others = _other_readers(root, (*chain, *operands.broadcast), node)
    own = source.tensor
    reads_source = not others and own.shape == weight.shape and torch.equal(own, weight)
    return GemmAsLinear(node, operands.x, source, chain, weight, reads_source)


def _weight_node(match: GemmAsLinear, program: ExportedProgram) -> tuple[Node, bool]:
    """W itself, or the constant V (one per V of W, shared by the GEMMs reading it);
    and whether it was added here."""
    if match.reads_source:
        return match.source.node, False
    stem = f"_etfold_{match.source.fqn}_linear_weight"
    for name in constant_names(stem, match.weight):
        held = constant_holding(program, name.replace(".", "_"), match.weight)
        if held is not None:
            return held, False
    constant = add_lifted_constant(program, stem, match.weight)
    if "custom" in match.source.node.meta:  # external-data tags go with the data
        constant.meta["custom"] = dict(match.source.node.meta["custom"])
    return constant, True


def rewrite_as_linear(match: GemmAsLinear, program: ExportedProgram) -> None:
    node, graph = match.node, match.node.graph
    weight, added = _weight_node(match, program)
    with graph.inserting_before(node):
        linear = graph.call_function(aten.linear.default, (match.x, weight))
    linear.meta = dict(node.meta)
    read = [n for n in node.all_input_nodes if n is not match.x]
    node.replace_all_uses_with(linear)
    graph.erase_node(node)
    drop_unread(read)
    source = match.source.node
    still_read = tuple(sorted(user.name for user in readers(source)))
    if not still_read and source is not weight:
        for check in list(source.users):
            graph.erase_node(check)
        remove_unread_placeholder(program, source)
    record_applied(FOLD, node.name, _detail(match, added, still_read))


def _detail(match: GemmAsLinear, added: bool, still_read: tuple[str, ...]) -> str:
    n, k = match.weight.shape
    fqn = match.source.fqn
    if match.reads_source:
        return f"linear over `{fqn}` itself ([{n}, {k}])"
    if not still_read:
        return f"linear over a [{n}, {k}] re-layout of `{fqn}`, which it replaces: no bytes added"
    cost = f"{match.weight.nbytes} B added" if added else "shared with another linear"
    return (
        f"linear over a [{n}, {k}] re-layout of `{fqn}`, which {', '.join(still_read)} "
        f"also read: the delegate owns its copy, {cost}"
    )


def gemms_with_constant_operands_as_linear(
    program: ExportedProgram, *, bf16: bool
) -> ExportedProgram:
    """`program`, or a rewritten copy where some GEMM with a constant operand is a linear.

    `bf16`: whether XNNPACK compiles the linear in bf16 here."""
    if is_training_program(program):
        record_declined(FOLD, "program", "training program (backward signature): W stays trainable")
        return program
    dtypes = delegated_floats(bf16)
    judged = [program_facts(program)]

    def on_copy(copied: ExportedProgram) -> None:
        judged.append(program_facts(copied))

    def match(node: Node) -> GemmAsLinear | Declined | None:
        return match_gemm(node, judged[-1], dtypes)

    return rewrite_matches_on_a_copy(
        program, match, lambda found: rewrite_as_linear(found, judged[-1].program), FOLD, on_copy
    )
