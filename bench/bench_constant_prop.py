# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Fold time of etfold's constant_prop_pass vs upstream's, side by side in one process.

    .venv/bin/python bench/bench_constant_prop.py [--repeats N]

Rows: a parameter-only chain of 100/200/400/600 ops (linear growth), 16 nested
squarings, and every weight transpose of a 12-layer decoder at Edge level (where
`linear` became `permute_copy(W)` + `addmm`). Each pass runs on its own deep copy
of the same program; the copy is not timed. Ratio = etfold / upstream. "ops after"
counts call_function nodes left by upstream's pass / etfold's (default options).
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time

import torch
from executorch.exir import to_edge
from executorch.exir.passes.constant_prop_pass import (
    constant_prop_pass as upstream_constant_prop_pass,
)

from etfold.exir.passes import constant_prop_pass


class Chain(torch.nn.Module):
    def __init__(self, length: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(64, 64))
        self.length = length

    def forward(self, x):
        w = self.w
        for i in range(self.length):
            w = w + 0.001 * (i % 3) if i % 2 else w * 0.999
        return x @ w


class Squarings(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(64, 64) * 0.1 + 0.95)

    def forward(self, x):
        w = self.w
        for _ in range(16):
            w = w * w
        return x @ w


class DecoderLayer(torch.nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.RMSNorm(dim)
        self.norm2 = torch.nn.RMSNorm(dim)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate = torch.nn.Linear(dim, hidden, bias=False)
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (
            p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for p in (self.q, self.k, self.v)
        )
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


class Decoder(torch.nn.Module):
    def __init__(self, layers=12, dim=256, heads=4, hidden=768, vocab=512):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(DecoderLayer(dim, heads, hidden) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def fold_seconds(run, program, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        fresh = copy.deepcopy(program)
        start = time.perf_counter()
        run(fresh)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def count_ops(program) -> int:
    return sum(1 for n in program.graph.nodes if n.op == "call_function")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("etfold").setLevel(logging.WARNING)
    torch.manual_seed(0)

    cases = []
    for length in (100, 200, 400, 600):
        cases.append((f"chain {length}", torch.export.export(Chain(length), (torch.randn(2, 64),))))
    cases.append(("16 nested squarings", torch.export.export(Squarings(), (torch.randn(2, 64),))))
    decoder = Decoder().eval()
    edge = to_edge(torch.export.export(decoder, (torch.randint(0, 512, (1, 16)),)))
    cases.append(("12-layer decoder (Edge)", edge.exported_program()))

    print(
        f"{'case':<26}{'ops':>6}{'ops after':>12}{'upstream s':>12}{'etfold s':>10}{'ratio':>8}{'etfold us/op':>14}"
    )
    for name, program in cases:
        theirs = fold_seconds(upstream_constant_prop_pass, program, args.repeats)
        ours = fold_seconds(constant_prop_pass, program, args.repeats)
        after = count_ops(constant_prop_pass(copy.deepcopy(program)))
        upstream_after = count_ops(upstream_constant_prop_pass(copy.deepcopy(program)))
        before = count_ops(program)
        print(
            f"{name:<26}{before:>6}{f'{upstream_after}/{after}':>12}{theirs:>12.4f}{ours:>10.4f}{ours / theirs:>8.2f}"
            f"{1e6 * ours / max(before, 1):>14.1f}"
        )


if __name__ == "__main__":
    main()
