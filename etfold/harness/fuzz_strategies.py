# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Hypothesis strategies for the four fold families, drawing `etfold.harness.generated` cases.

Also the two settings profiles: "ci" (seeded through derandomize, a few
examples per family, no shrinking: a failing case prints itself as its repro)
and "long" (used by tools/fuzz.py, which sets its own example counts and seeds).
"""

from __future__ import annotations

import dataclasses
import math
import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from etfold.demo_models.arm_dyt import DYT_CONV_KINDS
from etfold.harness.generated_converts import REGION_OPS, ConvertRegion, ConvertsCase
from etfold.harness.generated_dyt import DyTCase
from etfold.harness.generated_scalar_mul import (
    CONV_KINDS,
    NON_FINITE_SCALES,
    SCALE_VALUES,
    ScalarMulCase,
)
from etfold.harness.generated_upstream_folds import (
    BACKENDS,
    CHAIN_OPS,
    EXTRA_READERS,
    LAYER_KINDS,
    SHARE_MODES,
    UpstreamFoldsCase,
)
from etfold.harness.generated_weight_fold import WEIGHT_EXPRESSIONS, GemmLayer, WeightFoldCase

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

# Examples per family in the CI profile: each costs two or three real lowerings.
CI_EXAMPLES = int(os.environ.get("ETFOLD_FUZZ_CI_EXAMPLES", "2"))

settings.register_profile(
    "ci",
    max_examples=CI_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=_QUIET,
    print_blob=False,
)

seeds = st.integers(0, 2**16)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---------------------------------------------------------------- weight fold


@st.composite
def gemm_layers(draw, in_channels: int, first: bool, share: str, dtype: str) -> GemmLayer:
    kinds = ["conv", "conv", "linear", "conv_transpose"]
    if first and share == "operand":
        kinds = ["conv", "linear"]  # the operand is the weight's mean over its out-channel rows
    kind = draw(st.sampled_from(kinds))
    out_channels = draw(st.integers(1, 8))
    expressions = sorted(WEIGHT_EXPRESSIONS)
    if dtype != "float32":  # torch has no half-precision QR or matrix_exp on CPU
        expressions = [e for e in expressions if not e.startswith("orthogonal")]
    weight = draw(st.sampled_from(expressions))
    if kind == "linear":
        return GemmLayer(kind, out_channels, bias=draw(st.booleans()), weight=weight)
    groups = draw(st.sampled_from(_divisors(math.gcd(in_channels, out_channels))))
    return GemmLayer(
        kind,
        out_channels,
        kernel=draw(st.integers(1, 4)),
        stride=draw(st.sampled_from([1, 1, 2])),
        dilation=draw(st.sampled_from([1, 1, 2])),
        groups=groups,
        bias=draw(st.booleans()),
        weight=weight,
        activation=draw(st.sampled_from(["none", "relu", "tanh"])),
    )


@st.composite
def weight_fold_cases(draw) -> WeightFoldCase:
    dims = draw(st.sampled_from([1, 2]))
    in_channels = draw(st.integers(1, 6))
    share = draw(st.sampled_from(["none", "none", "tied", "derived", "operand"]))
    dtype = draw(st.sampled_from(["float32", "float32", "float32", "float16", "bfloat16"]))
    layers, channels = [], in_channels
    for index in range(draw(st.integers(1, 3))):
        layer = draw(gemm_layers(channels, index == 0, share, dtype))
        layers.append(layer)
        channels = layer.out_channels
    return WeightFoldCase(
        seed=draw(seeds),
        dims=dims,
        in_channels=in_channels,
        size=tuple(draw(st.integers(1, 7)) for _ in range(dims)),
        batch=draw(st.integers(1, 2)),
        layers=tuple(layers),
        share=share,
        buffer=draw(
            st.sampled_from(
                ["none", "none", "read", "written_by_other_method", "written_in_forward"]
            )
        ),
        second_method=draw(st.booleans()),
        dtype=dtype,
    )


# ---------------------------------------------------------------- converts

_DTYPES = ["float32", "float16", "bfloat16"]


@st.composite
def converts_cases(draw) -> ConvertsCase:
    regions = draw(
        st.lists(
            st.builds(
                ConvertRegion,
                dtype=st.sampled_from(_DTYPES),
                op=st.sampled_from(REGION_OPS),
                channels_last=st.booleans(),
            ),
            min_size=1,
            max_size=4,
        )
    )
    return ConvertsCase(
        seed=draw(seeds),
        channels=draw(st.integers(1, 5)),
        size=(draw(st.integers(1, 5)), draw(st.integers(1, 9))),
        model_dtype=draw(st.sampled_from(_DTYPES)),
        regions=tuple(regions),
    )


# ---------------------------------------------------------------- Arm scalar-mul


@st.composite
def scalar_mul_cases(draw) -> ScalarMulCase:
    conv = draw(st.sampled_from(sorted(CONV_KINDS)))
    even = st.sampled_from([2, 4, 6])
    grouped = conv == "grouped"
    values = draw(st.sampled_from([*SCALE_VALUES, *NON_FINITE_SCALES]))
    case = ScalarMulCase(
        seed=draw(seeds),
        conv=conv,
        in_channels=draw(even if grouped else st.integers(1, 6)),
        out_channels=draw(even if grouped else st.integers(1, 6)),
        size=draw(st.integers(3, 7)),
        bias=draw(st.booleans()),
        scale_kind=draw(
            st.sampled_from(["scalar", "per_channel", "per_channel", "spatial", "activation"])
        ),
        scale_values=values,
        scale_first=draw(st.booleans()),
        share=draw(st.sampled_from([False, False, True])),
        state=draw(st.sampled_from(["none", "none", "buffer", "marked_output"])),
        # a non-finite scale cannot be calibrated: it is checked in fp32
        profile="FP"
        if values in NON_FINITE_SCALES
        else draw(st.sampled_from(["INT", "INT", "FP"])),
    )
    if not case.share:  # drawn last, so every earlier field keeps its recorded draw
        return case
    return dataclasses.replace(case, shared_input=draw(st.sampled_from(["same", "mirrored"])))


# ---------------------------------------------------------------- Arm DyT


@st.composite
def dyt_cases(draw) -> DyTCase:
    conv = draw(st.sampled_from(sorted(DYT_CONV_KINDS)))
    smallest = 3 if conv == "3x3_unpadded" else 1
    alpha = draw(st.sampled_from([0.5, 1.0, 0.1, 2.5])) * draw(st.sampled_from([1, 1, -1]))
    return DyTCase(
        seed=draw(seeds),
        channels=draw(st.integers(1, 8)),
        out_channels=draw(st.integers(1, 8)),
        size=(draw(st.integers(smallest, 6)), draw(st.integers(smallest, 6))),
        nhwc=draw(st.booleans()),
        between=draw(st.sampled_from(["none", "none", "slice", "permute_back_and_forth"])),
        conv=conv,
        gamma=draw(st.sampled_from(["identity", "random"])),
        beta=draw(st.sampled_from(["zero", "random"])),
        alpha=alpha,
        bias=draw(st.booleans()),  # drawn last, so every earlier field keeps its recorded draw
    )


# ---------------------------------------------------------------- upstream's folds

_SHARES_NEEDING = {"bias": "bias", "weight_and_bias": "bias", "equal_bias": "bias"}
_SHARES_NEEDING.update(bn="bn", equal_bn="bn", scale="scale_channel", equal_scale="scale_channel")


@st.composite
def upstream_folds_cases(draw) -> UpstreamFoldsCase:
    share = draw(st.sampled_from(sorted(SHARE_MODES)))
    chain = draw(st.lists(st.sampled_from(CHAIN_OPS), min_size=0, max_size=2))
    if draw(st.sampled_from([True, True, True, False])):
        chain = ["bn", *chain]  # a batch norm right after the layer: what the fusions match
    needed = _SHARES_NEEDING.get(share)
    if needed not in (None, "bias") and needed not in chain:
        chain.append(needed)
    layer = draw(st.sampled_from(sorted(LAYER_KINDS)))
    case = UpstreamFoldsCase(
        seed=draw(seeds),
        layer=layer,
        in_channels=draw(st.integers(1, 6)),
        out_channels=draw(st.integers(1, 6)),
        size=draw(st.integers(3, 6)),
        batch=draw(st.integers(1, 3)),
        bias=needed == "bias" or draw(st.booleans()),
        chain=tuple(chain),
        share=share,
        extra_reader=draw(st.sampled_from(["none", "none", *EXTRA_READERS[1:]])),
        mirrored=draw(st.booleans()),
        combine=draw(st.sampled_from(["tuple", "sum"])),
        backend=draw(st.sampled_from(BACKENDS)),
        stride=1 if layer == "linear" else draw(st.sampled_from([1, 1, 2])),
    )
    if share != "bn":  # drawn last, so every earlier field keeps its recorded draw
        return case
    return dataclasses.replace(case, bn_shared=draw(st.sampled_from(["module", "gamma"])))


FAMILIES = {
    "weight_fold": weight_fold_cases(),
    "converts": converts_cases(),
    "scalar_mul": scalar_mul_cases(),
    "dyt": dyt_cases(),
    "upstream_folds": upstream_folds_cases(),
}
