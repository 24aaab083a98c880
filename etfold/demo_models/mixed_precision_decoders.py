# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Tiny mixed-precision decoders: Gemma3 and Llama in bf16/fp16, random weights.

Both keep parts of their math in fp32 (RMSNorm, rotary frequencies, softmax
or logit soft-capping), so a bf16 or fp16 export is full of fp32 <-> bf16/fp16
converts, which is what etfold's XNNPACK dtype-convert delegation is for.
Configs are written here; weights come from a seeded init, never a download.
"""

from __future__ import annotations

import torch

from etfold.demo_models.base import DemoModel

SEQUENCE = 32


class LogitsOnly(torch.nn.Module):
    """`input_ids -> logits`, without a KV cache, so the export is one plain graph."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def tiny_gemma3(
    dtype: torch.dtype,
    *,
    hidden: int = 256,
    vocab: int = 1000,
    layers: int = 2,
    initializer_range: float = 0.02,
) -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=hidden // 4,
        max_position_embeddings=128,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"][:layers],
        attn_implementation="sdpa",
        initializer_range=initializer_range,
    )
    torch.manual_seed(0)
    return LogitsOnly(Gemma3ForCausalLM(config).to(dtype).eval()).eval()


def tiny_llama(
    dtype: torch.dtype,
    *,
    hidden: int = 128,
    vocab: int = 1000,
    layers: int = 2,
    initializer_range: float = 0.02,
) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="sdpa",
        initializer_range=initializer_range,
    )
    torch.manual_seed(0)
    return LogitsOnly(LlamaForCausalLM(config).to(dtype).eval()).eval()


def token_ids(vocab: int = 1000, length: int = SEQUENCE) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(1))


def _decoder(make, dtype: torch.dtype):
    """The report's builder for `make(dtype)` on the shared token ids."""

    def build():
        return make(dtype), (token_ids(),)

    return build


MODELS = [
    DemoModel(
        "gemma3_tiny_bf16",
        "xnnpack",
        _decoder(tiny_gemma3, torch.bfloat16),
        "Gemma3 (2 layers, hidden 256) in bf16: fp32 RMSNorm/rotary converts between bf16 ops",
        fp32_twin=_decoder(tiny_gemma3, torch.float32),
        partitioner_kwargs={"enable_bf16": True},
        requires=("transformers",),
    ),
    DemoModel(
        "gemma3_tiny_fp16",
        "xnnpack",
        _decoder(tiny_gemma3, torch.float16),
        "Gemma3 (2 layers, hidden 256) in fp16: fp32 RMSNorm/rotary converts between fp16 ops",
        fp32_twin=_decoder(tiny_gemma3, torch.float32),
        requires=("transformers",),
    ),
    DemoModel(
        "llama_tiny_bf16",
        "xnnpack",
        _decoder(tiny_llama, torch.bfloat16),
        "Llama (2 layers, hidden 128) in bf16: fp32 RMSNorm/rotary converts between bf16 ops",
        fp32_twin=_decoder(tiny_llama, torch.float32),
        partitioner_kwargs={"enable_bf16": True},
        requires=("transformers",),
    ),
    DemoModel(
        "llama_tiny_fp16",
        "xnnpack",
        _decoder(tiny_llama, torch.float16),
        "Llama (2 layers, hidden 128) in fp16: fp32 RMSNorm/rotary converts between fp16 ops",
        fp32_twin=_decoder(tiny_llama, torch.float32),
        requires=("transformers",),
    ),
]
