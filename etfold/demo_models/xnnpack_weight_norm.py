# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""weight_norm models: stock XNNPACK declines their computed weights, etfold folds them.

The builders take sizes so `bench/bench_weight_fold.py` can use the full sizes
while the report keeps stock's portable-kernel runs short.
"""

from __future__ import annotations

import torch
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from etfold.demo_models.base import DemoModel


class PositionalConv(torch.nn.Module):
    """wav2vec2's positional conv embedding: weight_norm grouped conv, same-pad trim, GELU."""

    def __init__(self, channels: int = 1024, kernel: int = 128, groups: int = 16):
        super().__init__()
        conv = torch.nn.Conv1d(channels, channels, kernel, padding=kernel // 2, groups=groups)
        self.conv = weight_norm(conv, name="weight", dim=2)
        self.trim = 1 if kernel % 2 == 0 else 0

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = self.conv(hidden_states)
        if self.trim:
            h = h[:, :, : -self.trim]
        return torch.nn.functional.gelu(h)


def positional_conv(
    frames: int, *, channels: int = 1024, kernel: int = 128, groups: int = 16, seed: int = 0
):
    torch.manual_seed(seed)
    module = PositionalConv(channels, kernel, groups).eval()
    return module, (torch.randn(1, channels, frames),)


HIFIGAN_SMALL = dict(
    model_in_dim=32,
    upsample_initial_channel=64,
    upsample_rates=(4, 4),
    upsample_kernel_sizes=(8, 8),
    resblock_kernel_sizes=(3, 7, 11),
    resblock_dilation_sizes=((1, 3, 5), (1, 3, 5), (1, 3, 5)),
)


def hifigan(frames: int, *, seed: int = 0, **config):
    """transformers' SpeechT5HifiGan, random weights from a small config, with apply_weight_norm()."""
    from transformers import SpeechT5HifiGan, SpeechT5HifiGanConfig

    torch.manual_seed(seed)
    cfg = SpeechT5HifiGanConfig(**{**HIFIGAN_SMALL, **config})
    module = SpeechT5HifiGan(cfg).eval()
    module.apply_weight_norm()
    return module, (torch.randn(1, frames, cfg.model_in_dim),)


def remove_parametrizations(module: torch.nn.Module) -> torch.nn.Module:
    """Bake every parametrization into a plain parameter (the hand-folded reference)."""
    for sub in list(module.modules()):
        if parametrize.is_parametrized(sub):
            for name in list(sub.parametrizations.keys()):
                parametrize.remove_parametrizations(sub, name, leave_parametrized=True)
    return module


MODELS = [
    DemoModel(
        "wav2vec2_pos_conv",
        "xnnpack",
        lambda: positional_conv(100),
        "wav2vec2-large positional conv: weight_norm(Conv1d(1024,1024,128,groups=16),dim=2)+GELU at T=100 "
        "(the benchmark uses T=499; stock runs the conv on portable kernels)",
    ),
    DemoModel(
        "pos_conv_small",
        "xnnpack",
        lambda: positional_conv(100, channels=256, kernel=32),
        "the same positional conv a quarter as wide: weight_norm(Conv1d(256,256,32,groups=16),dim=2)"
        "+GELU at T=100 (stock's portable conv takes seconds per call at full size)",
        default=True,
    ),
    DemoModel(
        "speecht5_hifigan_small",
        "xnnpack",
        lambda: hifigan(24),
        "SpeechT5HifiGan (transformers) with a small random config and apply_weight_norm(), 24 frames",
        requires=("transformers",),
    ),
]
