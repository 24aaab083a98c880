# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Interleaved rotary embedding in one XNNPACK delegate: stock vs etfold, in one process.

    .venv/bin/python bench/bench_rotary.py [--budget SECONDS] [--layers N]

ExecuTorch llama's `apply_rotary_emb` (real/imaginary pairs unbound from the last dim,
rotated, stacked back) on q [1, T, 9, 64] and k [1, T, 3, 64] with T-row tables,
SmolLM2-135M's head shapes, repeated for `--layers` layers (default 8), at T = 32
(prefill) and T = 1 (decode), static shapes, random inputs, one thread.

Stock: upstream `XnnpackPartitioner` through upstream's entry point (its delegates take
the arithmetic; the squeezes stay on portable kernels). etfold: etfold's partitioner
and entry point, where `last_dim_unbinds_and_stacks_transposed` makes the pairs rows
of a transpose. Also timed: etfold with that rewrite left out, to show what it alone
gives. Columns: delegates / ops outside, median ms per call, and each ratio to stock
as the median (p10-p90) of per-round ratios (below 1: faster than stock). Outputs
are checked equal to eager, bit for bit.
"""

from __future__ import annotations

import argparse

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.backends.xnnpack.partition import pre_decomposition_rewrites as rewrites
from etfold.exir import to_edge_transform_and_lower
from etfold.harness.bench_models import RotaryLayers as Layers
from etfold.harness.bench_models import rotary_inputs as _inputs
from etfold.harness.timing import time_interleaved
from etfold.harness.xnnpack_runner import lower_xnnpack

REWRITE = "last_dim_unbinds_and_stacks_transposed"


def _without_the_rewrite():
    """The declared rewrites less this one (the rest run as they would)."""
    kept = tuple(r for r in rewrites.PRE_DECOMPOSITION_REWRITES if r.name != REWRITE)
    assert len(kept) == len(rewrites.PRE_DECOMPOSITION_REWRITES) - 1

    class Without(XnnpackPartitioner):
        def transform_for_pre_decomposition(self, program):
            program = super(XnnpackPartitioner, self).transform_for_pre_decomposition(program)
            return rewrites.run_rewrites(self, program, kept)

    return Without()


def lowered(module: torch.nn.Module, inputs: tuple) -> dict:
    export = lambda: torch.export.export(module, inputs)  # noqa: E731
    return {
        "stock": lower_xnnpack(export(), [UpstreamXnnpackPartitioner()]),
        "etfold": lower_xnnpack(
            export(), [XnnpackPartitioner()], lower=to_edge_transform_and_lower
        ),
        "etfold without": lower_xnnpack(
            export(), [_without_the_rewrite()], lower=to_edge_transform_and_lower
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=6.0, help="seconds of timing per row")
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _unsafe_reset_threadpool(1)
    module = Layers(args.layers).eval()
    for tokens in (32, 1):
        inputs = _inputs(tokens)
        programs = lowered(module, inputs)
        expected = module(*inputs)
        for name, program in programs.items():
            actual = program.run(*inputs)
            assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True)), name
        timing = time_interleaved(
            {name: (lambda p=p, i=inputs: p.run(*i)) for name, p in programs.items()},
            budget_s=args.budget,
            min_rounds=20,
        )
        print(f"\n== T = {tokens}, {args.layers} layers ({timing.rounds} rounds x {timing.inner})")
        for name, program in programs.items():
            ms = timing.milliseconds[name]
            ratio = "" if name == "stock" else timing.ratios[("stock", name)]
            shown = (
                f"; /stock {ratio.median:.3f} ({ratio.p10:.3f}-{ratio.p90:.3f})" if ratio else ""
            )
            outside = sum(program.ops_outside().values())
            print(f"{name:16} {program.delegates()} / {outside}: {ms.median:.4f} ms{shown}")


if __name__ == "__main__":
    main()
