# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Half precision written two ways: an fp16 encoder, and a decoder under torch.autocast.

- `TinyEncoder`: a BERT-style encoder (post-norm LayerNorm, GELU MLP) in fp16 at
  hidden 384, where the portable fp16 layer_norm loses the result (NaN in the
  logits of stock lowering); etfold computes layer_norm in fp32.
- `TinyDecoder`: a Qwen2-style decoder (RMSNorm, q/k/v with bias, rotary, SiLU
  MLP) with fp32 weights whose GEMMs run in bf16, either under
  `torch.autocast("cpu", torch.bfloat16)` (`cast="autocast"`) or with the same
  casts written out (`cast="explicit"`): the twins compute the same function,
  and etfold lowers them alike.

Configs are written here; weights come from a seeded init, never a download.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from etfold.demo_models.base import DemoModel

SEQUENCE = 32
VOCAB = 1000


def token_ids(length: int = SEQUENCE) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(1))


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    batch, length, width = x.shape
    return x.view(batch, length, heads, width // heads).transpose(1, 2)


class EncoderLayer(torch.nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.out = torch.nn.Linear(hidden, hidden)
        self.attention_norm = torch.nn.LayerNorm(hidden, eps=1e-12)
        self.up = torch.nn.Linear(hidden, 4 * hidden)
        self.down = torch.nn.Linear(4 * hidden, hidden)
        self.mlp_norm = torch.nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t, self.heads) for t in self.qkv(x).chunk(3, dim=-1))
        scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        context = (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)
        x = self.attention_norm(x + self.out(context))
        return self.mlp_norm(x + self.down(F.gelu(self.up(x))))


class TinyEncoder(torch.nn.Module):
    """BERT-style: token + position embeddings, LayerNorm, post-norm layers."""

    def __init__(self, hidden: int = 384, heads: int = 6, layers: int = 2):
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, hidden)
        self.positions = torch.nn.Embedding(SEQUENCE, hidden)
        self.norm = torch.nn.LayerNorm(hidden, eps=1e-12)
        self.layers = torch.nn.ModuleList(EncoderLayer(hidden, heads) for _ in range(layers))
        self.register_buffer("position_ids", torch.arange(SEQUENCE)[None], persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = self.position_ids[:, : input_ids.shape[1]]
        x = self.norm(self.tokens(input_ids) + self.positions(positions))
        for layer in self.layers:
            x = layer(x)
        return x


def tiny_encoder(dtype: torch.dtype = torch.float16, hidden: int = 384) -> torch.nn.Module:
    torch.manual_seed(0)
    module = TinyEncoder(hidden)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.8, 1.2)
            elif parameter.dim() >= 2:
                parameter.normal_(0.0, 0.02 if "layers" in name else 1.0)
    return module.to(dtype).eval()


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class DecoderLayer(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, gemm):
        super().__init__()
        self.heads, self.gemm = heads, gemm
        self.q = torch.nn.Linear(hidden, hidden)
        self.k = torch.nn.Linear(hidden, hidden)
        self.v = torch.nn.Linear(hidden, hidden)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.gate = torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.up = torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.attention_norm = RMSNorm(hidden)
        self.mlp_norm = RMSNorm(hidden)

    def forward(self, x, cos, sin, mask):
        h = self.attention_norm(x)
        q, k, v = (
            _heads(self.gemm.linear(layer, h), self.heads) for layer in (self.q, self.k, self.v)
        )
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        scores = self.gemm.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        weights = (scores.float() + mask).softmax(-1).to(v.dtype)
        context = self.gemm.matmul(weights, v).transpose(1, 2).flatten(2)
        x = x + self.gemm.linear(self.o, context)
        h = self.mlp_norm(x)
        mlp = F.silu(self.gemm.linear(self.gate, h)) * self.gemm.linear(self.up, h)
        return x + self.gemm.linear(self.down, mlp)


class AutocastGemms:
    """What autocast does to a GEMM on CPU: nothing written; the region casts."""

    dtype = torch.bfloat16

    @staticmethod
    def linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return layer(x)

    @staticmethod
    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b

    def region(self):
        return torch.autocast("cpu", dtype=self.dtype)


class ExplicitGemms(AutocastGemms):
    """The same casts written out: each GEMM reads its operands in bf16."""

    @classmethod
    def linear(cls, layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        bias = None if layer.bias is None else layer.bias.to(cls.dtype)
        return F.linear(x.to(cls.dtype), layer.weight.to(cls.dtype), bias)

    @classmethod
    def matmul(cls, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.to(cls.dtype) @ b.to(cls.dtype)

    def region(self):
        return contextlib.nullcontext()


class Fp32Gemms(ExplicitGemms):
    """No casts at all: the fp32 twin the bf16 programs are measured against."""

    linear = staticmethod(AutocastGemms.linear)  # plain GEMMs, no autocast region around them
    matmul = staticmethod(AutocastGemms.matmul)


class TinyDecoder(torch.nn.Module):
    """Qwen2-style, fp32 weights, bf16 GEMMs (`cast` "autocast" or "explicit"; "fp32": none)."""

    def __init__(self, cast: str, hidden: int = 128, heads: int = 4, layers: int = 2):
        super().__init__()
        self.gemm = {"autocast": AutocastGemms, "explicit": ExplicitGemms, "fp32": Fp32Gemms}[
            cast
        ]()
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.layers = torch.nn.ModuleList(
            DecoderLayer(hidden, heads, self.gemm) for _ in range(layers)
        )
        self.norm = RMSNorm(hidden)
        self.head = torch.nn.Linear(hidden, VOCAB, bias=False)
        head_dim = hidden // heads
        inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(SEQUENCE).float(), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        mask = torch.full((SEQUENCE, SEQUENCE), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        cos, sin = self.cos[:length], self.sin[:length]
        mask = self.mask[:length, :length]
        with self.gemm.region():
            x = self.embed(input_ids)
            for layer in self.layers:
                x = layer(x, cos, sin, mask)
            return self.gemm.linear(self.head, self.norm(x))


def tiny_decoder(cast: str, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyDecoder(cast, layers=layers).eval()


MODELS = [
    DemoModel(
        "encoder_fp16_layer_norm",
        "xnnpack",
        lambda: (tiny_encoder(), (token_ids(),)),
        "BERT-style encoder in fp16 at hidden 384: stock's portable fp16 layer_norm gives NaN",
    ),
    DemoModel(
        "decoder_autocast_bf16",
        "xnnpack",
        lambda: (tiny_decoder("autocast"), (token_ids(),)),
        "Qwen2-style decoder, fp32 weights, exported under torch.autocast(bfloat16)",
        fp32_twin=lambda: (tiny_decoder("fp32"), (token_ids(),)),
    ),
    DemoModel(
        "decoder_block_autocast_bf16",
        "xnnpack",
        lambda: (tiny_decoder("autocast", layers=1), (token_ids(),)),
        "one block of that decoder (embedding, a layer, the head) under torch.autocast(bfloat16)",
        fp32_twin=lambda: (tiny_decoder("fp32", layers=1), (token_ids(),)),
        default=True,
    ),
    DemoModel(
        "decoder_explicit_bf16",
        "xnnpack",
        lambda: (tiny_decoder("explicit"), (token_ids(),)),
        "the same decoder with autocast's casts written out (its explicitly cast twin)",
        fp32_twin=lambda: (tiny_decoder("fp32"), (token_ids(),)),
    ),
]
