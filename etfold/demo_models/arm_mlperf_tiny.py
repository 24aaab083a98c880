# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""ExecuTorch's own MLPerf Tiny models (`executorch.examples.models.mlperf_tiny`) for the
Arm NPU bench: DS-CNN keyword spotting, MobileNetV1-0.25 visual wake words, ResNet8
on CIFAR-10 and the anomaly-detection deep autoencoder. Random weights under a fixed
seed, inputs in [-1, 1) as upstream's examples draw them. No etfold fold applies to
them today; they are here so that one which starts to shows its cost on the NPU.
"""

from __future__ import annotations

import importlib

import torch

from etfold.demo_models.base import DemoModel

_UPSTREAM = "executorch.examples.models.mlperf_tiny"


def _mlperf_tiny(class_name: str, *shape: int):
    def uniform(generator: torch.Generator) -> tuple[torch.Tensor]:
        return (torch.rand(*shape, generator=generator) * 2 - 1,)

    def build():
        torch.manual_seed(0)
        module = getattr(importlib.import_module(_UPSTREAM), class_name)().eval()
        return module, uniform(torch.Generator().manual_seed(0))

    def calibration():
        generator = torch.Generator().manual_seed(1)
        return [uniform(generator) for _ in range(5)]

    return build, calibration


DS_CNN = _mlperf_tiny("DSCNNKWS", 1, 1, 49, 10)
MOBILENET_V1_025 = _mlperf_tiny("MobileNetV1025", 1, 3, 96, 96)
RESNET8 = _mlperf_tiny("ResNet8", 1, 3, 32, 32)
DEEP_AUTOENCODER = _mlperf_tiny("DeepAutoEncoder", 1, 640)

MODELS = [
    DemoModel(
        "mlperf_tiny_ds_cnn",
        "arm",
        DS_CNN[0],
        "MLPerf Tiny keyword spotting: ExecuTorch's DS-CNN, random weights",
        calibration=DS_CNN[1],
    ),
    DemoModel(
        "mlperf_tiny_mobilenet_v1_025",
        "arm",
        MOBILENET_V1_025[0],
        "MLPerf Tiny visual wake words: ExecuTorch's MobileNetV1-0.25, random weights",
        calibration=MOBILENET_V1_025[1],
    ),
    DemoModel(
        "mlperf_tiny_resnet8",
        "arm",
        RESNET8[0],
        "MLPerf Tiny image classification: ExecuTorch's ResNet8, random weights",
        calibration=RESNET8[1],
    ),
    DemoModel(
        "mlperf_tiny_deep_autoencoder",
        "arm",
        DEEP_AUTOENCODER[0],
        "MLPerf Tiny anomaly detection: ExecuTorch's deep autoencoder, random weights",
        calibration=DEEP_AUTOENCODER[1],
    ),
]
