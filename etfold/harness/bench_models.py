# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The models bench/*.py lowers, in one place the benchmarks and the tests both import.

The builders here are the benchmarks' own (random weights, seeded; configs in
code): bench scripts import them, so a test that lowers `bench_models()`
lowers what the benchmarks lower. Each `BenchModel` names one program as a
benchmark lowers it by default (its size, dtype and partitioner arguments; the
production-width decoders at the two layers of `bench_decoders.py --layers 2`)
and the flavours it lowers it with. The report models a benchmark lowers the
way `etfold report` does (bench_dtype_converts.py, bench_dyt.py) are the
report's, listed in `REPORT_MODELS_LOWERED_BY_BENCH`; bench_arm_npu.py lowers
the Arm report models for the Ethos-U NPUs, which the report also does for its
cycle estimates. bench_constant_prop.py runs one pass on an Edge program and
lowers nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from etfold.demo_models.mixed_precision_decoders import LogitsOnly, token_ids

Built = tuple[torch.nn.Module, tuple]


@dataclass(frozen=True)
class BenchModel:
    """A program a benchmark lowers: `build()` gives the module and its example inputs.

    `flavours`: "stock" (upstream's entry point and XnnpackPartitioner) and/or
    "etfold" (etfold's); `dynamic_shapes()` gives the export's dynamic shapes
    when the benchmark exports with them.
    """

    name: str
    script: str  # the bench/ script lowering it
    build: Callable[[], Built]
    partitioner_kwargs: Mapping[str, Any] = field(default_factory=dict)
    flavours: tuple[str, ...] = ("stock", "etfold")
    dynamic_shapes: Callable[[], Any] | None = None
    requires: tuple[str, ...] = ()  # Python modules beyond etfold's core dependencies


# ---- bench_decoders.py: production-shaped transformers models, random weights


class HiddenStatesOnly(torch.nn.Module):
    """`waveform -> last_hidden_state`, one tensor out."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_values: torch.Tensor) -> torch.Tensor:
        return self.model(input_values).last_hidden_state


def smollm2_360m(layers: int):
    """SmolLM2-360M's shape, random weights, fp32; 32 token ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=960,
        intermediate_size=2560,
        num_hidden_layers=layers or 32,
        num_attention_heads=15,
        num_key_value_heads=5,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LogitsOnly(LlamaForCausalLM(config).eval()).eval(), (token_ids(49152, 32),)


def wav2vec2_large(layers: int):
    """wav2vec2-large-lv60's shape, random weights, fp32; 1 s of 16 kHz audio."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    config = Wav2Vec2Config(
        hidden_size=1024,
        num_hidden_layers=layers or 24,
        num_attention_heads=16,
        intermediate_size=4096,
        hidden_act="gelu",
        conv_dim=(512,) * 7,
        conv_stride=(5, 2, 2, 2, 2, 2, 2),
        conv_kernel=(10, 3, 3, 3, 3, 2, 2),
        conv_bias=True,
        feat_extract_norm="layer",
        feat_extract_activation="gelu",
        do_stable_layer_norm=True,
        num_conv_pos_embeddings=128,
        num_conv_pos_embedding_groups=16,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    audio = torch.randn(1, 16000, generator=torch.Generator().manual_seed(1))
    return HiddenStatesOnly(Wav2Vec2Model(config).eval()).eval(), (audio,)


def bert_base(layers: int):
    """bert-base-uncased's shape, random weights, fp32; 128 token ids, no padding mask."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=30522,
        hidden_size=768,
        num_hidden_layers=layers or 12,
        num_attention_heads=12,
        intermediate_size=3072,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = BertModel(config, add_pooling_layer=False).eval()
    return HiddenStatesOnly(model).eval(), (token_ids(30522, 128),)


def vit_base(layers: int):
    """vit-base-patch16-224's shape, random weights, fp32; one 224x224 image."""
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(
        hidden_size=768,
        num_hidden_layers=layers or 12,
        num_attention_heads=12,
        intermediate_size=3072,
        image_size=224,
        patch_size=16,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    image = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    return HiddenStatesOnly(ViTModel(config, add_pooling_layer=False).eval()).eval(), (image,)


def whisper_base_encoder(layers: int):
    """whisper-base's encoder shape, random weights, fp32; 30 s of 80-bin log-mel features."""
    from transformers import WhisperConfig, WhisperModel

    config = WhisperConfig(
        d_model=512,
        encoder_layers=layers or 6,
        encoder_attention_heads=8,
        encoder_ffn_dim=2048,
        decoder_layers=1,
        decoder_attention_heads=8,
        num_mel_bins=80,
        max_source_positions=1500,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    features = torch.randn(1, 80, 3000, generator=torch.Generator().manual_seed(1))
    return HiddenStatesOnly(WhisperModel(config).get_encoder().eval()).eval(), (features,)


DECODERS = {
    "smollm2_360m": smollm2_360m,
    "wav2vec2_large": wav2vec2_large,
    "bert_base": bert_base,
    "vit_base": vit_base,
    "whisper_base_encoder": whisper_base_encoder,
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def decoder_in_dtype(model: str, dtype: torch.dtype, layers: int) -> Built:
    """The seeded model in `dtype` (built in fp32, then cast) and its inputs (float ones
    in `dtype` too: audio, images)."""
    module, inputs = DECODERS[model](layers)
    return module.to(dtype), in_dtype(inputs, dtype)


def in_dtype(inputs: tuple, dtype: torch.dtype) -> tuple:
    return tuple(i.to(dtype) if i.is_floating_point() else i for i in inputs)


# ---- bench_recurrent.py


class RecurrentHead(torch.nn.Module):
    def __init__(self, cell: type[torch.nn.Module], size: int, hidden: int, out: int = 10):
        super().__init__()
        self.rnn = cell(input_size=size, hidden_size=hidden, batch_first=True)
        self.linear = torch.nn.Linear(hidden, hidden)
        self.linear2 = torch.nn.Linear(hidden, out)

    def forward(self, x):
        x, _ = self.rnn(x)
        x = self.linear2(self.linear(x[:, -1, :]))
        return torch.nn.functional.log_softmax(x, dim=1)


RECURRENT = {
    "lstm": (torch.nn.LSTM, 32, 32, (1, 32, 32)),
    "gru": (torch.nn.GRU, 32, 32, (1, 32, 32)),
    "lstm_large": (torch.nn.LSTM, 128, 256, (1, 50, 128)),
}


def recurrent(name: str) -> Built:
    cell, size, hidden, shape = RECURRENT[name]
    torch.manual_seed(0)
    module = RecurrentHead(cell, size, hidden).eval()
    return module, (torch.rand(*shape),)


# ---- bench_rotary.py: ExecuTorch llama's interleaved rotary embedding, layer after layer


def _apply_rotary_emb(q, k, cos, sin):
    from executorch.examples.models.llama.rope import apply_rotary_emb

    return apply_rotary_emb(q, k, cos, sin)


class RotaryLayers(torch.nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.layers = layers

    def forward(self, q, k, cos, sin):
        for _ in range(self.layers):
            q, k = _apply_rotary_emb(q, k, cos, sin)
        return q, k


def rotary_inputs(tokens: int) -> tuple:
    """q and k with SmolLM2-135M's head shapes, and T-row tables."""
    gen = torch.Generator().manual_seed(tokens)
    q, k = (
        torch.randn(1, tokens, 9, 64, generator=gen),
        torch.randn(1, tokens, 3, 64, generator=gen),
    )
    return q, k, torch.randn(tokens, 32, generator=gen), torch.randn(tokens, 32, generator=gen)


# ---- bench_warm_lowering.py and bench_first_lowering.py: small programs, lowering time


WARM_LOWERING_MODELS = ("small CNN", "attention")


def warm_lowering_models() -> dict[str, Built]:
    from etfold.demo_models.arm_npu_blocks import Attention

    torch.manual_seed(0)
    conv = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3), torch.nn.GELU()
    )
    return {
        "small CNN": (conv.eval(), (torch.randn(1, 3, 16, 16),)),
        "attention": (Attention(32, 2).eval(), (torch.randn(1, 8, 32),)),
    }


class QkvAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return torch.softmax(q @ k.transpose(-1, -2) / 32**0.5, -1) @ v


def first_lowering_model(model: str) -> Built:
    """bench_first_lowering.py's "conv" or "attention" (eval mode)."""
    torch.manual_seed(0)
    if model == "conv":
        module = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3)
        )
        return module.eval(), (torch.randn(1, 3, 16, 16),)
    return QkvAttention().eval(), (torch.randn(1, 8, 32),)


# ---- bench_weight_fold.py: parameter-only GEMM weights

HIFIGAN_BENCH = dict(
    model_in_dim=80,
    upsample_initial_channel=128,
    upsample_rates=(4, 4),
    upsample_kernel_sizes=(8, 8),
    resblock_kernel_sizes=(3, 7, 11),
    resblock_dilation_sizes=((1, 3, 5), (1, 3, 5), (1, 3, 5)),
)


def _spectral(seed: int = 0) -> Built:
    from torch.nn.utils.parametrizations import spectral_norm

    torch.manual_seed(seed)
    return spectral_norm(torch.nn.Linear(1024, 1024)).eval(), (torch.randn(1, 128, 1024),)


def _conv2d(seed: int = 0) -> Built:
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(seed)
    return weight_norm(torch.nn.Conv2d(64, 128, 3)).eval(), (torch.randn(1, 64, 56, 56),)


def weight_fold_models(frames: int) -> dict[str, Callable[[], Built]]:
    from etfold.demo_models.xnnpack_weight_norm import hifigan, positional_conv

    return {
        "pos_conv": lambda: positional_conv(frames),
        "spectral": _spectral,
        "conv2d": _conv2d,
        "hifigan": lambda: hifigan(64, **HIFIGAN_BENCH),
    }


def hand_folded(build: Callable[[], Built]) -> Callable[[], Built]:
    """The same model built again from the same seed with every parametrization removed."""
    from etfold.demo_models.xnnpack_weight_norm import remove_parametrizations

    def built() -> Built:
        module, inputs = build()
        return remove_parametrizations(module), inputs

    return built


# ---- bench_llm_export.py: small HF models, static and dynamic


def hf_models():
    """name -> (module, static inputs, the dynamic dim of their axis 1)."""
    from torch.export import Dim
    from transformers import BertConfig, BertModel

    from etfold.demo_models.mixed_precision_decoders import tiny_llama
    from etfold.harness.sequence_models import LastHiddenState, tiny_wav2vec2

    torch.manual_seed(0)
    bert = BertModel(
        BertConfig(
            vocab_size=1000,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=512,
            attn_implementation="sdpa",
        ),
        add_pooling_layer=False,
    )
    wav2vec2 = tiny_wav2vec2()
    audio = torch.randn(1, 16000, generator=torch.Generator().manual_seed(1))
    return {
        "bert": (
            LastHiddenState(bert).eval(),
            (token_ids(1000, 64),),
            Dim("tokens", min=8, max=128),
        ),
        "wav2vec2": (
            wav2vec2,
            (audio,),
            320 * Dim("frames", min=13, max=100),
        ),
        "llama": (tiny_llama(torch.float32), (token_ids(1000, 32),), Dim("tokens", min=4, max=64)),
    }


# ---- the registry

# bench_decoders.py's rows: every model in fp32, bf16 where it runs in bf16, SmolLM2 in fp16 too
DECODER_DTYPES = {
    "smollm2_360m": ("fp32", "bf16", "fp16"),
    "wav2vec2_large": ("fp32",),
    "bert_base": ("fp32", "bf16"),
    "vit_base": ("fp32", "bf16"),
    "whisper_base_encoder": ("fp32", "bf16"),
}
DECODER_LAYERS = 2  # bench_decoders.py --layers 2, its quick run
WEIGHT_FOLD_FRAMES = 499  # bench_weight_fold.py's default --frames
ROTARY_LAYERS = 8  # bench_rotary.py's default --layers

# bench script -> the report models it lowers as `etfold report` does (XNNPACK models
# with their fp32 twins; Arm models on TOSA INT)
REPORT_MODELS_LOWERED_BY_BENCH = {
    "bench_dtype_converts": (
        "gemma3_tiny_bf16",
        "gemma3_tiny_fp16",
        "llama_tiny_bf16",
        "llama_tiny_fp16",
    ),
    "bench_dyt": ("dyt_convnext_block",),
}


def _decoders() -> list[BenchModel]:
    return [
        BenchModel(
            f"{model}_{dtype}_{DECODER_LAYERS}_layers",
            "bench_decoders",
            lambda model=model, dtype=dtype: decoder_in_dtype(model, DTYPES[dtype], DECODER_LAYERS),
            partitioner_kwargs={"enable_bf16": True} if dtype == "bf16" else {},
            requires=("transformers",),
        )
        for model, dtypes in DECODER_DTYPES.items()
        for dtype in dtypes
    ]


def _weight_folds() -> list[BenchModel]:
    builders = weight_fold_models(WEIGHT_FOLD_FRAMES)
    requires = {"hifigan": ("transformers",)}
    return [
        entry
        for name, build in builders.items()
        for entry in (
            BenchModel(name, "bench_weight_fold", build, requires=requires.get(name, ())),
            BenchModel(
                f"{name}_hand_folded",
                "bench_weight_fold",
                hand_folded(build),
                flavours=("stock",),
                requires=requires.get(name, ()),
            ),
        )
    ]


def _hf(name: str, dynamic: bool) -> BenchModel:
    def build() -> Built:
        module, inputs, _ = hf_models()[name]
        return module, inputs

    def dynamic_shapes():
        return ({1: hf_models()[name][2]},)

    return BenchModel(
        f"hf_{name}_{'dynamic' if dynamic else 'static'}",
        "bench_llm_export",
        build,
        dynamic_shapes=dynamic_shapes if dynamic else None,
        requires=("transformers",),
    )


def bench_models() -> list[BenchModel]:
    """Every program bench/*.py lowers with XNNPACK that is not a report model."""
    models = [
        *_decoders(),
        *(BenchModel(n, "bench_recurrent", lambda n=n: recurrent(n)) for n in RECURRENT),
        *(
            BenchModel(
                f"rotary_{ROTARY_LAYERS}_layers_T{tokens}",
                "bench_rotary",
                lambda tokens=tokens: (RotaryLayers(ROTARY_LAYERS).eval(), rotary_inputs(tokens)),
            )
            for tokens in (32, 1)
        ),
        *(
            BenchModel(
                f"warm_{n.replace(' ', '_')}",
                "bench_warm_lowering",
                lambda n=n: warm_lowering_models()[n],
            )
            for n in WARM_LOWERING_MODELS
        ),
        *(
            BenchModel(f"first_{n}", "bench_first_lowering", lambda n=n: first_lowering_model(n))
            for n in ("conv", "attention")
        ),
        *_weight_folds(),
        *(
            _hf(name, dynamic)
            for name in ("bert", "wav2vec2", "llama")
            for dynamic in (False, True)
        ),
    ]
    names = [m.name for m in models]
    assert len(set(names)) == len(names), names
    return models


# ---- bench_llm_export.py: ExecuTorch's LLM export on a SmolLM2-135M-shaped checkpoint

LLM_EXPORT_MODES = ("fp32", "8da4w", "bf16")
LLM_EXPORT_MAX_SEQ_LENGTH = 128
LLM_EXPORT_LAYERS = 2  # bench_llm_export.py --layers 2, its quick run


def llm_export_shape(layers: int = LLM_EXPORT_LAYERS):
    from etfold.harness.llama_export import SMOLLM2_135M, LlamaShape

    return LlamaShape(**{**SMOLLM2_135M.__dict__, "n_layers": layers})
