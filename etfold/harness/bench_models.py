# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The models bench/*.py lowers, in one place the benchmarks and the tests both import.

The builders here are the benchmarks' own (random weights, seeded; configs in
code): bench scripts build from them, so a test that lowers `bench_models()`
lowers what the benchmarks lower. Each `BenchModel` names one program a
benchmark lowers, by default or when a flag picks it (bench_attention_masks.py
`--kinds finfo_min`, bench_dynamic_audio.py `--held-out`), at its default size,
dtype and partitioner arguments (the production-width decoders at the two layers
of `bench_decoders.py --layers 2`), and the flavours it lowers it with. A program
two benchmarks lower is registered once, under the first (bench_onnx_runtime.py
builds its bert, wav2vec2, llama, static hifigan and static lstm rows from
bench_llm_export's, bench_weight_fold's and bench_recurrent's entries). The
report models a benchmark lowers the way `etfold report` does
(bench_dtype_converts.py, bench_dyt.py) are the report's, listed in
`REPORT_MODELS_LOWERED_BY_BENCH`. test/etfold/test_bench_models_cover_bench.py
names the benchmarks that lower nothing with XNNPACK, and fails when one that
does has no entry here.
"""

from __future__ import annotations

import functools
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
    "etfold" (etfold's), those of the benchmark's lowerings that give a program (none:
    every one it tries fails, and it prints the failure); `dynamic_shapes()` gives the
    export's dynamic shapes when the benchmark exports with them.
    """

    name: str
    script: str  # the bench/ script lowering it
    build: Callable[[], Built]
    partitioner_kwargs: Mapping[str, Any] = field(default_factory=dict)
    flavours: tuple[str, ...] = ("stock", "etfold")
    dynamic_shapes: Callable[[], Any] | None = None
    requires: tuple[str, ...] = ()  # Python modules beyond etfold's core dependencies
    # the flavours lowered and planned inside `etfold.exir.declared_bounds_kept()`: etfold's
    # entry point refuses a program declared in samples whose planning would narrow its bounds
    bounds_kept: tuple[str, ...] = ()


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


def hifigan_bench() -> Built:
    """SpeechT5HifiGan with weight_norm at `HIFIGAN_BENCH`'s config, on 64 frames."""
    from etfold.demo_models.xnnpack_weight_norm import hifigan

    return hifigan(64, **HIFIGAN_BENCH)


def weight_fold_models(frames: int) -> dict[str, Callable[[], Built]]:
    """bench_weight_fold.py's models; `frames` is the positional conv's length (hifigan
    runs on 64 frames whatever it is)."""
    from etfold.demo_models.xnnpack_weight_norm import positional_conv

    return {
        "pos_conv": lambda: positional_conv(frames),
        "spectral": _spectral,
        "conv2d": _conv2d,
        "hifigan": hifigan_bench,
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


# ---- bench_attention_masks.py: attention under each kind of mask users give SDPA

MASK_FORM, MASK_BATCH, MASK_LENGTH = "11TT", 2, 16  # a [1, 1, T, T] mask, batch 2, T = 16


def masked_attention(kind: str) -> Built:
    """`MaskedAttention(kind)` (seeded) and its inputs at `MASK_LENGTH`."""
    from etfold.harness.masked_attention import MaskedAttention, masked_inputs

    torch.manual_seed(0)
    module = MaskedAttention(kind, MASK_FORM).eval()
    return module, masked_inputs(kind, MASK_FORM, MASK_BATCH)(MASK_LENGTH)


def masked_attention_length(kind: str):
    """The dynamic length of the sequence (and of a mask the caller gives): 2..23."""
    from etfold.harness.masked_attention import masked_length

    return masked_length(kind, MASK_FORM).dynamic_shapes()


# ---- bench_dynamic_audio.py: audio encoders declared in samples

AUDIO_SAMPLES = 16000  # the traced length
HELD_OUT_AUDIO = {  # model class: (config class, what differs from wav2vec2's config)
    "HubertModel": ("HubertConfig", {}),
    "WavLMModel": ("WavLMConfig", {"num_buckets": 32, "max_bucket_distance": 80}),
    "Data2VecAudioModel": ("Data2VecAudioConfig", {"num_conv_pos_embeddings": 5}),
    "UniSpeechModel": ("UniSpeechConfig", {}),
    "UniSpeechSatModel": ("UniSpeechSatConfig", {}),
    "SEWModel": ("SEWConfig", {"squeeze_factor": 2}),
    "SEWDModel": ("SEWDConfig", {"squeeze_factor": 2}),
    "Wav2Vec2ConformerModel": ("Wav2Vec2ConformerConfig", {"position_embeddings_type": "rotary"}),
}


def audio(samples: int) -> tuple[torch.Tensor]:
    """One clip of `samples` samples, drawn with the length as seed."""
    return (torch.randn(1, samples, generator=torch.Generator().manual_seed(samples)),)


def declared_in_samples() -> tuple:
    """Audio's length as users declare it: `Dim.DYNAMIC`, 4,000..32,000 samples."""
    return ({1: torch.export.Dim.DYNAMIC(min=4000, max=32000)},)


def short_conv_wav2vec2() -> Built:
    """`tiny_wav2vec2` with three feature convs (a frame per 20 samples), seeded, on 1 s."""
    from etfold.harness.sequence_models import SHORT_FEATURE_CONVS, tiny_wav2vec2

    torch.manual_seed(0)
    return tiny_wav2vec2(feature_convs=SHORT_FEATURE_CONVS), audio(AUDIO_SAMPLES)


def held_out_audio(name: str) -> Built:
    """transformers' `name` (another encoder of wav2vec2's kind) at the short-conv wav2vec2's
    shape, random weights, SDPA attention where transformers has it; on 1 s."""
    import transformers

    from etfold.harness.sequence_models import LastHiddenState

    config_name, differs = HELD_OUT_AUDIO[name]
    shape = dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=512,
        conv_dim=(64, 64, 64),
        conv_kernel=(10, 3, 3),
        conv_stride=(5, 2, 2),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
    )
    config = getattr(transformers, config_name)(**{**shape, **differs})
    torch.manual_seed(0)
    for attention in ("sdpa", "eager"):  # eager where transformers has no SDPA for it
        config._attn_implementation = attention
        try:
            module = LastHiddenState(getattr(transformers, name)(config)).eval()
        except ValueError:
            continue
        return module, audio(AUDIO_SAMPLES)
    raise ValueError(f"{name} builds with no attention implementation")


# ---- bench_onnx_runtime.py: the rows not lowered by another benchmark

ORT_BERT_BASE_LAYERS = 4


def ort_bert_base() -> Built:
    """bert-base's width (`bert_base`) at `ORT_BERT_BASE_LAYERS` layers."""
    return bert_base(ORT_BERT_BASE_LAYERS)


def mobilenet_v1_025() -> Built:
    """ExecuTorch's MLPerf Tiny MobileNetV1-0.25 on one 96x96 image (the report's Arm model)."""
    from etfold.demo_models.arm_mlperf_tiny import MOBILENET_V1_025

    return MOBILENET_V1_025[0]()


# ---- bench_reported_fallbacks.py: the fallbacks ExecuTorch users reported, as small modules


class TiedLogits(torch.nn.Module):
    """Whisper-style logits: a layer norm, then `x @ transpose(embedding.weight, 0, 1)`."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, ids):
        return self.norm(self.embedding(ids)) @ torch.transpose(self.embedding.weight, 0, 1)


class VitTail(torch.nn.Module):
    """A ViT / InternViT tail: leaky ReLU written as `where`, the CLS token, the token mean."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.project = torch.nn.Linear(width, width)

    def forward(self, x):
        x = self.project(x)
        x = torch.where(x > 0, x, 0.1 * x)
        return x[:, 0], x[:, 1:].mean(dim=1)


class GeluNewMlp(torch.nn.Module):
    """GPT-2 / ALBERT `gelu_new` between two linears (a `pow(x, 3)` inside)."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        h = self.up(x)
        inner = 0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))
        return self.down(0.5 * h * (1.0 + torch.tanh(inner)))


class MobileNetV3Block(torch.nn.Module):
    """Expand conv, hardswish, depthwise conv + BN, squeeze-excite, projection, residual."""

    def __init__(self, channels: int = 16, expanded: int = 64):
        super().__init__()
        self.expand = torch.nn.Conv2d(channels, expanded, 1)
        self.depthwise = torch.nn.Conv2d(expanded, expanded, 3, padding=1, groups=expanded)
        self.norm = torch.nn.BatchNorm2d(expanded)
        self.squeeze = torch.nn.Conv2d(expanded, channels, 1)
        self.excite = torch.nn.Conv2d(channels, expanded, 1)
        self.project = torch.nn.Conv2d(expanded, channels, 1)

    def forward(self, x):
        functional = torch.nn.functional
        h = functional.hardswish(self.expand(x))
        h = functional.hardswish(self.norm(self.depthwise(h)))
        pooled = functional.adaptive_avg_pool2d(h, 1)
        scale = functional.hardsigmoid(self.excite(functional.relu(self.squeeze(pooled))))
        return x + self.project(h * scale)


class HeadsOfTwoDynamicDims(torch.nn.Module):
    """`Linear(64, 128)(x).reshape(b, t, 4, 32)` then `Linear(32, 32)`, b and t dynamic."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 128), torch.nn.Linear(32, 32)

    def forward(self, x):
        batch, tokens, _ = x.shape
        return self.b(self.a(x).reshape(batch, tokens, 4, 32))


class NormBetweenLinears(torch.nn.Module):
    """`Linear -> LayerNorm -> Linear` of one width: stock cuts the delegate at the norm."""

    def __init__(self, width: int):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        return self.b(self.norm(self.a(x)))


class Fp16ConvSilu(torch.nn.Module):
    def __init__(self, channels: int = 16):
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return torch.nn.functional.silu(self.conv(x))


def _seeded(build: Callable[[], Built]) -> Callable[[], Built]:
    def built() -> Built:
        torch.manual_seed(0)
        module, inputs = build()
        return module.eval(), inputs

    return built


# name -> (builder, dynamic shapes or None); inputs drawn after the weights, one seed
REPORTED_FALLBACKS: dict[str, tuple[Callable[[], Built], Callable[[], Any] | None]] = {
    "tied_logits_tiny": (
        _seeded(lambda: (TiedLogits(100, 32), (torch.randint(0, 100, (1, 8)),))),
        None,
    ),
    "tied_logits_8192x384": (
        _seeded(lambda: (TiedLogits(8192, 384), (torch.randint(0, 8192, (1, 16)),))),
        None,
    ),
    "vit_tail": (_seeded(lambda: (VitTail(), (torch.randn(2, 17, 64),))), None),
    "gelu_new_mlp": (_seeded(lambda: (GeluNewMlp(), (torch.randn(2, 16, 64),))), None),
    "mobilenet_v3_block": (
        _seeded(lambda: (MobileNetV3Block(), (torch.randn(1, 16, 32, 32),))),
        None,
    ),
    "heads_of_two_dynamic_dims": (
        _seeded(lambda: (HeadsOfTwoDynamicDims(), (torch.randn(2, 16, 64),))),
        lambda: (
            {
                0: torch.export.Dim("batch", min=1, max=8),
                1: torch.export.Dim("tokens", min=2, max=64),
            },
        ),
    ),
    "fp16_conv_silu": (
        _seeded(
            lambda: (
                Fp16ConvSilu().to(torch.float16),
                (torch.randn(1, 16, 32, 32, dtype=torch.float16),),
            )
        ),
        None,
    ),
    # a layer norm between linears, rows x width: the sizes where the delegated norm's ops
    # cost the most (few short rows) and the widths of small and base encoders
    **{
        f"norm_between_linears_{rows}x{width}": (
            _seeded(
                lambda rows=rows, width=width: (
                    NormBetweenLinears(width),
                    (torch.randn(1, rows, width),),
                )
            ),
            None,
        )
        for rows, width in ((8, 32), (128, 64), (128, 768))
    },
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


def shaped(name: str, dynamic: bool) -> str:
    """The entry's name for `name` exported static or with its dynamic shapes."""
    return f"{name}_{'dynamic' if dynamic else 'static'}"


def _hf_build(name: str) -> Callable[[], Built]:
    def build() -> Built:
        module, inputs, _ = hf_models()[name]
        return module, inputs

    return build


# upstream's XNNPACK preprocess refuses wav2vec2 in whole frames ("Output node ... is already
# in the inputs"): stock has no dynamic program of it, and the benchmark says so
HF_STOCK_LOWERS_STATIC_ONLY = frozenset({"wav2vec2"})


def _hf(name: str, dynamic: bool) -> BenchModel:
    def dynamic_shapes():
        return ({1: hf_models()[name][2]},)

    stock_fails = dynamic and name in HF_STOCK_LOWERS_STATIC_ONLY
    return BenchModel(
        shaped(f"hf_{name}", dynamic),
        "bench_llm_export",
        _hf_build(name),
        flavours=("etfold",) if stock_fails else ("stock", "etfold"),
        dynamic_shapes=dynamic_shapes if dynamic else None,
        requires=("transformers",),
    )


def _masked_attention() -> list[BenchModel]:
    from etfold.harness.masked_attention import MASKS

    return [
        BenchModel(
            shaped(f"masked_attention_{kind}", dynamic),
            "bench_attention_masks",
            lambda kind=kind: masked_attention(kind),
            dynamic_shapes=(lambda kind=kind: masked_attention_length(kind)) if dynamic else None,
        )
        for kind in MASKS
        for dynamic in (False, True)
    ]


# held-out encoders etfold cannot lower with a dynamic length: none today. SEW's
# `torch.sym_min` of two lengths, which upstream's Edge verifier refuses (stock fails
# there), is decided over the bounds (`size_min_max_decided_over_the_bounds_pass`)
HELD_OUT_AUDIO_UNLOWERED_DYNAMIC: frozenset[str] = frozenset()


def _audio(name: str, build, flavours: tuple[str, ...], dynamic: bool) -> BenchModel:
    return BenchModel(
        shaped(name, dynamic),
        "bench_dynamic_audio",
        build,
        flavours=flavours,
        dynamic_shapes=declared_in_samples if dynamic else None,
        requires=("transformers",),
        bounds_kept=("etfold",),
    )


def _dynamic_audio() -> list[BenchModel]:
    """The short-conv wav2vec2, stock and etfold; with `--held-out` the other encoders of
    its kind, etfold's alone; etfold's lowered inside `declared_bounds_kept()`."""
    both = ("stock", "etfold")
    models = [_audio("wav2vec2_short_convs", short_conv_wav2vec2, both, d) for d in (False, True)]
    for model in HELD_OUT_AUDIO:
        build = functools.partial(held_out_audio, model)
        models.append(_audio(f"held_out_{model}", build, ("etfold",), False))
        dynamic = () if model in HELD_OUT_AUDIO_UNLOWERED_DYNAMIC else ("etfold",)
        models.append(_audio(f"held_out_{model}", build, dynamic, True))
    return models


def _along_axis_1(name: str, low: int, high: int) -> Callable[[], tuple]:
    return lambda: ({1: torch.export.Dim(name, min=low, max=high)},)


def _square_image() -> tuple:
    side = torch.export.Dim("side", min=64, max=128)
    return ({2: side, 3: side},)


def _onnx_runtime() -> list[BenchModel]:
    """bench_onnx_runtime.py's rows that no other benchmark lowers (its bert, wav2vec2 and
    llama rows are bench_llm_export's, its static hifigan bench_weight_fold's, its static
    lstm bench_recurrent's).

    The ORT bench lowers etfold's programs inside `declared_bounds_kept()`, as
    `etfold report` does; torch.export refuses the LSTM's dynamic steps, so no flavour
    lowers it."""
    script, transformers = "bench_onnx_runtime", ("transformers",)
    kept = ("etfold",)
    return [
        BenchModel(
            "hf_wav2vec2_dynamic_samples",
            script,
            _hf_build("wav2vec2"),
            dynamic_shapes=declared_in_samples,
            requires=transformers,
            bounds_kept=kept,
        ),
        BenchModel(
            shaped(f"bert_base_{ORT_BERT_BASE_LAYERS}_layers", False),
            script,
            ort_bert_base,
            requires=transformers,
            bounds_kept=kept,
        ),
        BenchModel(
            shaped(f"bert_base_{ORT_BERT_BASE_LAYERS}_layers", True),
            script,
            ort_bert_base,
            dynamic_shapes=_along_axis_1("tokens", 8, 256),
            requires=transformers,
            bounds_kept=kept,
        ),
        BenchModel(
            "hifigan_dynamic",
            script,
            hifigan_bench,
            dynamic_shapes=_along_axis_1("frames", 16, 128),
            requires=transformers,
            bounds_kept=kept,
        ),
        BenchModel("mobilenet_v1_025_static", script, mobilenet_v1_025, bounds_kept=kept),
        BenchModel(
            "mobilenet_v1_025_dynamic",
            script,
            mobilenet_v1_025,
            dynamic_shapes=_square_image,
            bounds_kept=kept,
        ),
        BenchModel(
            "lstm_dynamic",
            script,
            lambda: recurrent("lstm"),
            flavours=(),
            dynamic_shapes=_along_axis_1("steps", 8, 64),
            bounds_kept=kept,
        ),
    ]


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
        *_masked_attention(),
        *_dynamic_audio(),
        *_onnx_runtime(),
        *(
            BenchModel(name, "bench_reported_fallbacks", build, dynamic_shapes=shapes)
            for name, (build, shapes) in REPORTED_FALLBACKS.items()
        ),
    ]
    names = [m.name for m in models]
    assert len(set(names)) == len(names), names
    return models


def bench_model(name: str) -> BenchModel:
    """The registered program named `name`."""
    (model,) = (m for m in bench_models() if m.name == name)
    return model


# ---- bench_llm_export.py: ExecuTorch's LLM export on a SmolLM2-135M-shaped checkpoint

LLM_EXPORT_MODES = ("fp32", "8da4w", "bf16")
LLM_EXPORT_MAX_SEQ_LENGTH = 128
LLM_EXPORT_LAYERS = 2  # bench_llm_export.py --layers 2, its quick run


def llm_export_shape(layers: int = LLM_EXPORT_LAYERS):
    from etfold.harness.llama_export import SMOLLM2_135M, LlamaShape

    return LlamaShape(**{**SMOLLM2_135M.__dict__, "n_layers": layers})
