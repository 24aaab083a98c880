# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""ExecuTorch's LLM export (`export_llama`) on a random model, stock or etfold, and its .pte
on the wheel's runtime.

The model is `--model llama3` with a params file and a Meta-format checkpoint (the names
`tok_embeddings`, `layers.N.attention.wq`, ... that `export_llama` loads) written from a
`LlamaShape` with seeded random weights; nothing is downloaded. The program takes
`(tokens [1, n], input_pos [1])` and keeps its KV cache in mutable buffers: a prefill at
position 0, then one token at a time.
"""

from __future__ import annotations

import importlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

EXPORT_LLAMA_LIB = "executorch.examples.models.llama.export_llama_lib"
# export_llama's arguments per mode; every mode adds `-kv --use_sdpa_with_kv_cache -X
# --xnnpack-extended-ops` (KV cache, SDPA custom op, XNNPACK with its extended ops)
MODES: dict[str, tuple[str, ...]] = {
    "fp32": (),
    "8da4w": ("-qmode", "8da4w", "--group_size", "32"),
    "bf16": ("-d", "bf16"),
}
XNNPACK_KV_SDPA = ("-kv", "--use_sdpa_with_kv_cache", "-X", "--xnnpack-extended-ops")


@dataclass(frozen=True)
class LlamaShape:
    """The params file of a llama3-style model (`ModelArgs` field names)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    vocab_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_scaled_rope: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# One layer: every fold export_llama's program gets applies per layer (and a second layer
# doubled the test's two exports, 25 s each on 2 cores, to check nothing more)
TINY = LlamaShape(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=256)
# SmolLM2-135M's shape (its tied embedding written as two tensors, as Meta checkpoints hold them)
SMOLLM2_135M = LlamaShape(
    dim=576,
    n_layers=30,
    n_heads=9,
    n_kv_heads=3,
    hidden_dim=1536,
    vocab_size=49152,
    rope_theta=100000.0,
)


def meta_checkpoint(shape: LlamaShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the names `export_llama` loads (norm weights near 1)."""
    generator = torch.Generator().manual_seed(seed)

    def weight(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator) * (1.0 / size[-1] ** 0.5)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(shape.dim, generator=generator)

    d, h, q, kv = shape.dim, shape.hidden_dim, shape.n_heads, shape.n_kv_heads
    head = shape.head_dim
    state = {"tok_embeddings.weight": weight(shape.vocab_size, d)}
    for layer in range(shape.n_layers):
        prefix = f"layers.{layer}."
        state[prefix + "attention.wq.weight"] = weight(q * head, d)
        state[prefix + "attention.wk.weight"] = weight(kv * head, d)
        state[prefix + "attention.wv.weight"] = weight(kv * head, d)
        state[prefix + "attention.wo.weight"] = weight(d, q * head)
        state[prefix + "feed_forward.w1.weight"] = weight(h, d)
        state[prefix + "feed_forward.w3.weight"] = weight(h, d)
        state[prefix + "feed_forward.w2.weight"] = weight(d, h)
        state[prefix + "attention_norm.weight"] = norm()
        state[prefix + "ffn_norm.weight"] = norm()
    state["norm.weight"] = norm()
    state["output.weight"] = weight(shape.vocab_size, d)
    return state


def write_model_files(shape: LlamaShape, directory: Path, seed: int = 0) -> tuple[Path, Path]:
    """(params.json, checkpoint.pth) in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    params, checkpoint = directory / "params.json", directory / "checkpoint.pth"
    params.write_text(json.dumps(asdict(shape)))
    torch.save(meta_checkpoint(shape, seed), checkpoint)
    return params, checkpoint


def export_llama_arguments(
    params: Path, checkpoint: Path, mode: str, output: Path, max_seq_length: int = 32
) -> list[str]:
    """export_llama's command line for one mode, writing the .pte to `output`."""
    return [
        "--model",
        "llama3",
        "-c",
        str(checkpoint),
        "-p",
        str(params),
        *XNNPACK_KV_SDPA,
        *MODES[mode],
        "--max_seq_length",
        str(max_seq_length),
        "-o",
        str(output.parent),
        "-n",
        str(output),
    ]


def export_stock(arguments: Sequence[str]) -> bytes:
    """Upstream's `export_llama` on `arguments`; the .pte's bytes."""
    pipeline = importlib.import_module(EXPORT_LLAMA_LIB)
    path = pipeline.export_llama(pipeline.build_args_parser().parse_args(list(arguments)))
    return Path(path).read_bytes()


def export_etfold(arguments: Sequence[str]) -> bytes:
    """`etfold.llm_export.export_llama` on `arguments`; the .pte's bytes."""
    from etfold.llm_export import export_llama

    return Path(export_llama(list(arguments))).read_bytes()


def register_llm_runtime_kernels() -> None:
    """The KV-cache and SDPA custom ops' kernels, which the runtime needs to load the program."""
    importlib.import_module("executorch.extension.llm.custom_ops.custom_ops")


@dataclass
class LoadedLlama:
    """One load of a .pte (its own KV cache); keeps the bytes the runtime points into."""

    buffer: bytes
    program: object
    method: object

    def step(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """Logits of the last token of `tokens` (shape [1, n]) placed at `position`."""
        (logits,) = self.method.execute((tokens, torch.tensor([position], dtype=torch.long)))
        return logits


def load_llama(buffer: bytes, *, enable_etdump: bool = False) -> LoadedLlama:
    from executorch.runtime import Runtime

    register_llm_runtime_kernels()
    program = Runtime.get().load_program(buffer, enable_etdump=enable_etdump)
    return LoadedLlama(buffer, program, program.load_method("forward"))


def prefill_then_decode(buffer: bytes, prompt: torch.Tensor, next_token: int) -> list:
    """[prefill logits, logits of one decode step after it], on a fresh load."""
    llama = load_llama(buffer)
    prefill = llama.step(prompt, 0)
    decode = llama.step(torch.tensor([[next_token]], dtype=torch.long), prompt.shape[1])
    return [prefill.clone(), decode.clone()]


@dataclass(frozen=True)
class PteContents:
    """What the runtime executes for one method: delegate calls and kernels outside them."""

    delegate_calls: int
    ops_outside: Counter[str]


# runtime instructions that are bookkeeping, not ops: views, symbolic sizes and scalars
BOOKKEEPING = frozenset(
    {
        "executorch_prim::et_view.default",
        "aten::sym_size.int",
        "aten::_local_scalar_dense",
        "executorch_prim::add.Scalar",
        "executorch_prim::sub.Scalar",
        "executorch_prim::mul.Scalar",
        "executorch_prim::floordiv.Scalar",
    }
)


def pte_contents(buffer: bytes, method: str = "forward") -> PteContents:
    """Delegate calls and kernel calls (by operator) in the serialized program's `method`."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    pte = deserialize_pte_binary(buffer)
    program = getattr(pte, "program", pte)
    (plan,) = [p for p in program.execution_plan if p.name == method]
    names = [f"{op.name}.{op.overload}" if op.overload else op.name for op in plan.operators]
    delegate_calls, outside = 0, Counter()
    for chain in plan.chains:
        for instruction in chain.instructions:
            kind = type(instruction.instr_args).__name__
            if kind == "DelegateCall":
                delegate_calls += 1
            elif kind == "KernelCall":
                outside[names[instruction.instr_args.op_index]] += 1
    return PteContents(delegate_calls, outside)


def ops_outside(contents: PteContents, *, bookkeeping: bool = False) -> Counter[str]:
    """Kernel calls outside delegates, the bookkeeping ones left out unless asked for."""
    return Counter(
        {op: n for op, n in contents.ops_outside.items() if bookkeeping or op not in BOOKKEEPING}
    )
