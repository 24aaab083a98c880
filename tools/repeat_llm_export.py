# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""ExecuTorch's LLM export through `etfold.llm_export`, run again and again, each run in
a process of its own, every program's logits compared with stock's.

An export that fails only now and then (a collector, an id reused, another job's load)
shows only over many runs: this runs export_llama on a random SmolLM2-135M-shaped
checkpoint cut to `--layers`, stock once and etfold `--runs` times, the documented way
(`_export_llama(LlmConfig.from_args(...))` inside `collect_decisions()` and
`etfold_partitioners()`), and prints each run's delegates and largest logit difference.
It exits non-zero when a run fails or differs.

    .venv/bin/python tools/repeat_llm_export.py --runs 10 --layers 2 --mode 8da4w
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from etfold.harness import llama_export

EXPORT = """
import importlib, sys
import etfold
from executorch.extension.llm.export.config.llm_config import LlmConfig
pipeline = importlib.import_module("executorch.examples.models.llama.export_llama_lib")
config = LlmConfig.from_args(pipeline.build_args_parser().parse_args(sys.argv[2:]))
if sys.argv[1] == "etfold":
    from etfold.llm_export import etfold_partitioners
    with etfold.collect_decisions(), etfold_partitioners():
        pipeline._export_llama(config)
else:
    pipeline._export_llama(config)
"""


def _export(flavour: str, arguments: list[str]) -> str | None:
    """None, or the end of the failed process's error output."""
    done = subprocess.run(
        [sys.executable, "-c", EXPORT, flavour, *arguments], capture_output=True, text=True
    )
    return None if done.returncode == 0 else done.stderr[-4000:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--mode", choices=sorted(llama_export.MODES), default="8da4w")
    parser.add_argument("--atol", type=float, default=1e-4, help="largest logit difference")
    options = parser.parse_args()

    shape = dataclasses.replace(llama_export.SMOLLM2_135M, n_layers=options.layers)
    root = Path(tempfile.mkdtemp(prefix="etfold_llm_runs_"))
    params, checkpoint = llama_export.write_model_files(shape, root / "model")

    def arguments(name: str) -> list[str]:
        output = root / f"{name}.pte"
        listed = llama_export.export_llama_arguments(params, checkpoint, options.mode, output, 128)
        return [*listed, "--max_context_length", "128"]

    failure = _export("stock", arguments("stock"))
    if failure:
        print(f"stock's export failed:\n{failure}")
        return 2
    prompt = torch.randint(0, shape.vocab_size, (1, 8), generator=torch.Generator().manual_seed(3))
    expected = llama_export.prefill_then_decode((root / "stock.pte").read_bytes(), prompt, 17)
    good = 0
    for run in range(options.runs):
        failure = _export("etfold", arguments(f"etfold{run}"))
        if failure:
            print(f"run {run}: FAILED\n{failure}", flush=True)
            continue
        buffer = (root / f"etfold{run}.pte").read_bytes()
        outputs = llama_export.prefill_then_decode(buffer, prompt, 17)
        error = max((a - b).abs().max().item() for a, b in zip(outputs, expected, strict=True))
        delegates = llama_export.pte_contents(buffer).delegate_calls
        print(f"run {run}: {delegates} delegates, largest logit difference {error:.3g}", flush=True)
        good += error <= options.atol
    print(f"{good}/{options.runs} runs lowered with logits within {options.atol} of stock's")
    return 0 if good == options.runs else 1


if __name__ == "__main__":
    sys.exit(main())
