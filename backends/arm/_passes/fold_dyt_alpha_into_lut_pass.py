# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Fold DyT's alpha into the tanh lookup table (TOSA INT, after q/dq folding).

Given (int8 activation x, int8 scalar constant alpha, per-tensor RESCALEs R):

    m = R_out( R_x(x) * R_alpha(alpha) )          int32 MUL, requantized to int8
    y = tanh_q(m)                                  becomes TABLE(m, T_tanh)

Result:

    y = TABLE(x, T)    with   T[v + 128] = T_tanh[R_out(R_x(v) * R_alpha(alpha)) + 128]
                              for every int8 code v

T is the composition of the integer path with the table InsertTableOpsPass
would build for the tanh, evaluated with etfold's exact TOSA arithmetic, so the
output codes are bit-identical to the unfolded lowering. Runs before
InsertTableOpsPass (the tanh must still be an aten.tanh).

On Ethos-U, declines when x is read by anything besides the alpha multiply (a
residual stream, say): the TABLE would stop riding free as the MUL's fused
activation (`npu_costs.table_stays_fused`). Other TOSA targets fold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from executorch.backends.arm._passes.arm_pass_utils import create_node
from executorch.backends.arm._passes.insert_table_ops import InsertTableOpsPass
from executorch.backends.arm._passes.quant_args import QuantArgs
from executorch.exir import ExportedProgram
from executorch.exir.pass_base import ExportPass
from torch.fx import GraphModule, Node

from etfold.backends.arm._passes.constants import create_constant
from etfold.backends.arm._passes.dyt_match import (
    MUL,
    TABLE,
    TANH,
    Int32Constant,
    IntegerDyTFoldPass,
    erase_unused,
    int32_constant_operand,
    rescale_of,
    single_qargs,
)
from etfold.backends.arm._passes.npu_costs import table_stays_fused
from etfold.backends.arm._passes.tosa_integer import Rescale, fits_int32
from etfold.decisions import Declined
from etfold.exir.passes.node_shapes import node_value

FOLD = "arm.dyt_alpha_into_lut"

_INT8_CODES = torch.arange(-128, 128, dtype=torch.int64)


@dataclass(frozen=True)
class AlphaIntoTableMatch:
    tanh: Node
    activation: Node
    activation_qargs: QuantArgs
    output_qargs: QuantArgs
    table: torch.Tensor  # int8[256], indexed by activation code + 128
    alpha: float
    removed: tuple[Node, ...]  # the chain the TABLE replaces, consumers first
    table_like: Node  # a constant placeholder whose kind the new table takes (alpha's)


@dataclass(frozen=True)
class _Site:
    """A tanh fed by a requantized int32 MUL: the shape every DyT alpha takes."""

    tanh: Node
    requantize: Node
    mul: Node


def _site(tanh: Node) -> _Site | None:
    if tanh.op != "call_function" or tanh.target != TANH or not isinstance(tanh.args[0], Node):
        return None
    requantize = tanh.args[0]
    if rescale_of(requantize) is None:
        return None
    mul = requantize.args[0]
    if mul.op != "call_function" or mul.target != MUL:
        return None
    return _Site(tanh, requantize, mul)


# --- predicates: each answers Declined(reason), or None when it holds -----------------


def tanh_is_int8_per_tensor(site: _Site) -> Declined | None:
    for key in ("input_qparams", "output_qparams"):
        qargs = single_qargs(site.tanh, key)
        if qargs is None or qargs.dtype != torch.int8:
            return Declined(f"tanh {key} are not one int8 per-tensor quantization")
    return None


def product_feeds_only_tanh(site: _Site) -> Declined | None:
    if len(site.mul.users) != 1 or len(site.requantize.users) != 1:
        return Declined("the alpha product has users other than the tanh")
    return None


def requantize_matches_tanh_input(site: _Site) -> Declined | None:
    rescale = rescale_of(site.requantize)
    tanh_in = single_qargs(site.tanh, "input_qparams")
    if rescale.output_dtype != torch.int8 or rescale.output_zp != tanh_in.get_zp_per_tensor():
        return Declined(
            "quantization metadata mismatch: the requantized product is not the tanh's int8 input"
        )
    return None


def alpha_is_scalar_constant(alpha: Int32Constant | None) -> Declined | None:
    if alpha is None or alpha.values.numel() != 1:
        return Declined("no operand of the multiply is a scalar int8 constant (alpha)")
    return None


def activation_is_int8_rescale(activation_operand: Node) -> Declined | None:
    rescale = rescale_of(activation_operand)
    if rescale is None or rescale.output_dtype != torch.int32:
        return Declined(
            "the activation operand is not a plain int8->int32 RESCALE (reshaped or unquantized)"
        )
    source = activation_operand.args[0]
    value = node_value(source)
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int8:
        return Declined("the activation feeding the multiply is not int8")
    return None


def activation_qargs_agree(
    site: _Site, activation_operand: Node, index: int
) -> QuantArgs | Declined:
    """The activation's int8 quantization, reconstructed from the MUL's int32 input scale."""
    int32_qargs = (site.mul.meta.get("input_qparams") or {}).get(index)
    if (
        not isinstance(int32_qargs, QuantArgs)
        or int32_qargs.per_channel
        or int32_qargs.dtype != torch.int32
    ):
        return Declined(
            "quantization metadata mismatch: the multiply has no int32 input quantization"
        )
    rescale = rescale_of(activation_operand)
    qargs = QuantArgs(
        scale=rescale.scale * int32_qargs.get_scale_per_tensor(),
        zp=rescale.input_zp,
        qmin=-128,
        qmax=127,
        dtype=torch.int8,
    )
    produced = single_qargs(activation_operand.args[0], "output_qparams")
    if produced is not None and (
        produced.dtype != torch.int8 or produced.get_zp_per_tensor() != qargs.zp
    ):
        return Declined(
            "quantization metadata mismatch: activation zero point disagrees with its producer"
        )
    return qargs


def table_stays_fused_on_the_npu(activation_operand: Node) -> Declined | None:
    sole_reader = len(activation_operand.args[0].users) == 1 and len(activation_operand.users) == 1
    return table_stays_fused(sole_reader)


def product_stays_in_int32(activation: Rescale, alpha: Int32Constant) -> Declined | None:
    if not fits_int32(activation.apply(_INT8_CODES) * int(alpha.values.reshape(()))):
        return Declined("the int32 alpha product overflows for some int8 input")
    return None


# --- match / rewrite ----------------------------------------------------------


def _composed_table(
    site: _Site, activation: Rescale, alpha: Int32Constant, table_builder
) -> torch.Tensor:
    tanh_in = single_qargs(site.tanh, "input_qparams")
    tanh_out = single_qargs(site.tanh, "output_qparams")
    tanh_table, _ = table_builder.generate_8bit_table_values(torch.tanh, tanh_in, tanh_out)
    product = activation.apply(_INT8_CODES) * int(alpha.values.reshape(()))
    tanh_codes = rescale_of(site.requantize).apply(product)
    return tanh_table.reshape(-1)[(tanh_codes + 128).to(torch.int64)].to(torch.int8)


def match_alpha_into_table(
    exported_program: ExportedProgram, tanh: Node
) -> AlphaIntoTableMatch | Declined | None:
    """None: not a tanh(alpha * x) site at all. Declined: a site that must not fold."""
    site = _site(tanh)
    if site is None:
        return None
    for check in (tanh_is_int8_per_tensor, product_feeds_only_tanh, requantize_matches_tanh_input):
        if (declined := check(site)) is not None:
            return declined
    operands = [a for a in site.mul.args[:2] if isinstance(a, Node)]
    if len(operands) != 2:
        return Declined("the multiply does not take two tensor operands")
    constants = [int32_constant_operand(exported_program, a) for a in operands]
    scalar = [i for i, c in enumerate(constants) if c is not None and c.values.numel() == 1]
    if (
        declined := alpha_is_scalar_constant(constants[scalar[0]] if len(scalar) == 1 else None)
    ) is not None:
        return declined
    alpha = constants[scalar[0]]
    activation_index = 1 - scalar[0]
    activation_operand = operands[activation_index]
    if (declined := activation_is_int8_rescale(activation_operand)) is not None:
        return declined
    if (declined := table_stays_fused_on_the_npu(activation_operand)) is not None:
        return declined
    activation_qargs = activation_qargs_agree(site, activation_operand, activation_index)
    if isinstance(activation_qargs, Declined):
        return activation_qargs
    activation_rescale = rescale_of(activation_operand)
    if (declined := product_stays_in_int32(activation_rescale, alpha)) is not None:
        return declined
    table = _composed_table(site, activation_rescale, alpha, InsertTableOpsPass(exported_program))
    alpha_qargs = (site.mul.meta.get("input_qparams") or {}).get(scalar[0])
    alpha_value = (
        float(alpha.values.reshape(())) * alpha_qargs.get_scale_per_tensor()
        if alpha_qargs
        else float("nan")
    )
    return AlphaIntoTableMatch(
        tanh=tanh,
        activation=activation_operand.args[0],
        activation_qargs=activation_qargs,
        output_qargs=single_qargs(tanh, "output_qparams"),
        table=table,
        alpha=alpha_value,
        removed=(tanh, site.requantize, site.mul, activation_operand, *alpha.nodes, alpha.source),
        table_like=alpha.source,
    )


def rewrite_alpha_into_table(
    exported_program: ExportedProgram, graph_module: GraphModule, match: AlphaIntoTableMatch
) -> Node:
    graph = graph_module.graph
    table_constant = create_constant(
        graph_module,
        exported_program,
        like=match.table_like,
        stem=f"b_{match.tanh.name}_dyt_table_constant",
        data=match.table,
    )
    with graph.inserting_before(match.tanh):
        table = create_node(
            graph, TABLE, args=(match.activation, table_constant), from_node=match.tanh
        )
    table.meta["input_qparams"] = {0: match.activation_qargs}
    table.meta["output_qparams"] = {0: match.output_qargs}
    match.tanh.replace_all_uses_with(table)
    erase_unused(graph_module, exported_program, match.removed)
    return table


class FoldDyTAlphaIntoLUTPass(IntegerDyTFoldPass):
    """`TABLE_tanh(R(R(x) * R(alpha)))` -> `TABLE_composed(x)`; see the module docstring."""

    FOLD = FOLD
    _passes_required_after: set[type[ExportPass]] = {InsertTableOpsPass}

    def match(self, node: Node) -> AlphaIntoTableMatch | Declined | None:
        return match_alpha_into_table(self.exported_program, node)

    def rewrite(self, graph_module: GraphModule, match: AlphaIntoTableMatch) -> str:
        rewrite_alpha_into_table(self.exported_program, graph_module, match)
        return f"tanh(alpha * x) -> one TABLE (alpha = {match.alpha:.6g})"
