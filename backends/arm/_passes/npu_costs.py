# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Where a fold costs Ethos-U cycles: the rules, per target, in one place.

Vela schedules the same TOSA graph differently on each NPU, so a fold that
removes an operator can still cost cycles where Vela then runs what remains
worse. Each rule states the Vela behaviour behind it and returns a `Declined`
naming the cost it avoids, or None where the fold is free on the target being
lowered for. A lowering with no Ethos-U target (plain TOSA) has no NPU schedule
to protect, so every rule passes there. `bench/bench_arm_npu.py` measures each.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from etfold.backends.arm._passes.layout_axes import Layout, layout_kind
from etfold.backends.arm._passes.lowering_target import ethos_u_target
from etfold.decisions import Declined

# Ethos-U55 and U65 share one NPU architecture (Vela documents their TOSA
# constraints together); the U85 is a different one.
_U55_FAMILY = ("ethos-u55", "ethos-u65")


def _in_u55_family(target: str) -> bool:
    return target.startswith(_U55_FAMILY)


def multiply_keeps_the_transpose(mul: Node) -> Declined | None:
    """On U85, a multiply a transpose reads may not fold away into its layer.

    Vela gives a TRANSPOSE to the op producing its input, which then writes its
    output in the transposed order. Unfolded the multiply takes it; folded the
    layer would, and on U85 a conv or fully connected layer writing a transposed
    output runs far slower (Linear(1280, 320) over 2x2 tokens, scaled and then
    permuted to NCHW: 52,632 cycles unfolded, 3,200,570 folded). A transpose
    between the layer and the multiply goes to the layer either way: that folds.
    U55/U65 run the folded layer as fast as the unfolded one.
    """
    target = ethos_u_target()
    if target is None or not target.startswith("ethos-u85"):
        return None
    if not any(layout_kind(user) in (Layout.PERMUTE, Layout.TRANSPOSE) for user in mul.users):
        return None
    return Declined(
        f"on {target} a transpose reads the multiply: folded, Vela would give it to the layer, "
        "which then writes its output transposed, far slower than the multiply it removes"
    )


def per_channel_scale_into_transposed_conv(
    channel_scale: torch.Tensor, *, before_calibration: bool = False
) -> Declined | None:
    """A scale that differs between channels may not fold into a transposed conv on U55/U65,
    nor before calibration while no NPU is named.

    There Vela cannot fuse a transposed conv's per-channel requantization into
    the conv: the RESCALE runs as elementwise passes of its own, one per distinct
    per-channel shift. Folding a scale that differs between channels spreads the
    channels' weight ranges, hence their shifts, over more binades: more passes
    than the one multiply the fold removes (`conv_scale_net`, U55: the upsampler's
    RESCALE went from one pass of 131,072 cycles plus the multiply's 16,384 to
    two passes, 98,304 + 81,920). A uniform scale moves every channel's range and
    the output's alike, so the shifts stay as they were. U85 fuses it.

    Before calibration (the annotation pipeline) the fold is final: the quantized
    program keeps it whatever it is lowered for next. A quantizer built from a
    TOSA spec rather than an Ethos-U one names no NPU, and its program can still
    go to Vela for a U55, so the fold declines there too. Quantize with
    `EthosUQuantizer` for a U85 (or lower a float program) to have it.
    """
    if channel_scale.unique().numel() == 1:
        return None
    target = ethos_u_target()
    if target is None and before_calibration:
        return Declined(
            "quantizing with no Ethos-U target named: the program may go to Vela for a U55/U65, "
            "which requantizes a transposed conv's output in standalone passes, one per distinct "
            "per-channel shift; a scale that differs between channels spreads the shifts"
        )
    if target is None or not _in_u55_family(target):
        return None
    return Declined(
        f"on {target} Vela requantizes a transposed conv's output in standalone passes, one "
        "per distinct per-channel shift; a scale that differs between channels spreads the "
        "shifts and costs more cycles than the multiply it removes"
    )


def table_stays_fused(sole_reader: bool) -> Declined | None:
    """A TABLE may move onto an activation only where it stays fused (Ethos-U).

    Vela fuses a TABLE into its producer as that op's activation. Unfolded, DyT's
    TABLE rides free behind the alpha multiply, whose output only it reads;
    moved onto an activation other ops also read (`sole_reader` False: a
    residual), it runs as an op of its own and costs more than the MUL it removes.
    """
    target = ethos_u_target()
    if target is None or sole_reader:
        return None
    return Declined(
        f"on {target} the TABLE is free as the alpha multiply's fused activation; folded it "
        "would read an activation other ops also read (a residual) and run standalone"
    )
