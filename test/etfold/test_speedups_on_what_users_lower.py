# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The lowering speed-ups change no byte of any program users get from etfold.

Users lower with the speed-ups on (etfold's entry point, `etfold report`,
`etfold lower`, the LLM export); the rest of the suite lowers with them off
(test/conftest.py). Here every program `etfold report --all` lowers (each report
model, each fp32 twin, each Arm model for TOSA INT and for each Ethos-U target
it estimates), every program bench/*.py lowers (`etfold.harness.bench_models`)
and ExecuTorch's LLM export through etfold, each flavour (stock: upstream's
entry point and partitioner, as the report's stock row; etfold: etfold's), is
lowered the way they lower it, inside `lowering_speedups(True)` and inside
`lowering_speedups(False)`, and the serialized programs must be equal byte for
byte. Building, export and quantization happen inside the scope too, as in the
report.

All cases run in the long profile (one test each, scheduled on either worker).
`make test` runs a rotating sample: one case of each stratum (report XNNPACK
models, report Arm programs, bench programs), taken from the cases that are
not `HEAVY` (a decoder, a timm ConvNeXt, a 50-step LSTM: tens of seconds
each). The turn is `ETFOLD_SPEEDUPS_TURN` when set, else the number of commits
(`git rev-list --count HEAD`), else the day of the year; turn t takes the case
at position t of each stratum's fixed shuffled order, so consecutive commits
cover consecutive cases, a run is repeated by setting its turn, and every case
comes round within as many commits as its stratum has cases. `make test` prints
the picked cases and the turn at its end.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import subprocess
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from etfold.demo_models import catalogue
from etfold.harness.bench_models import REPORT_MODELS_LOWERED_BY_BENCH, bench_models
from etfold.harness.lowering_speedups import lowering_speedups

ROOT = Path(__file__).resolve().parents[2]
TURN_VARIABLE = "ETFOLD_SPEEDUPS_TURN"
ROTATING_SAMPLE = "rotating sample"  # the user property test/conftest.py prints at the end
# Models whose pair of lowerings takes over ~15 s on 2 quiet cores (measured: 3-13 times a
# small conv net's): the long profile lowers them, the rotating sample does not.
HEAVY_REPORT_MODELS = frozenset(
    {
        *(f"decoder_{form}_bf16" for form in ("autocast", "block_autocast", "explicit")),
        *(f"{family}_tiny_{dtype}" for family in ("gemma3", "llama") for dtype in ("bf16", "fp16")),
        "encoder_fp16_layer_norm",
        "speecht5_hifigan_small",
        "convnext_atto_layerscale",
        "vit_dyt_layerscale_block",
        "mlperf_tiny_mobilenet_v1_025",
        "mlperf_tiny_resnet8",
        "scaled_conv_forms",
        *(
            f"conv_scale_net{seed}"
            for seed in ("", "_scales_seed1", "_scales_seed2", "_scales_seed3")
        ),
    }
)
HEAVY_BENCH_SCRIPTS = frozenset({"bench_decoders", "bench_llm_export"})
HEAVY_BENCH_MODELS = frozenset(
    {"lstm", "gru", "lstm_large", "hifigan", "hifigan_hand_folded"}
    | {f"rotary_8_layers_T{tokens}" for tokens in (32, 1)}
    | {"hf_wav2vec2_dynamic_samples", "hifigan_dynamic", "mobilenet_v1_025_dynamic"}
    | {f"bert_base_4_layers_{shapes}" for shapes in ("static", "dynamic")}
    | {
        f"{model}_{shapes}"
        for model in (
            "wav2vec2_short_convs",
            *(
                f"held_out_{encoder}Model"
                for encoder in (
                    "Hubert",
                    "WavLM",
                    "Data2VecAudio",
                    "UniSpeech",
                    "UniSpeechSat",
                    "SEW",
                    "SEWD",
                    "Wav2Vec2Conformer",
                )
            ),
        )
        for shapes in ("static", "dynamic")
    }
)
ETHOS_U_TARGETS = ("ethos-u55-128", "ethos-u85-256")  # etfold.harness.vela.TARGETS


@dataclass(frozen=True)
class Case:
    name: str
    stratum: str  # the rotating sample takes one case of each stratum per run
    heavy: bool  # in the long profile only
    lower: Callable[[], list[bytes]]  # the bytes of each program it lowers
    requires: tuple[str, ...] = ()


def _xnnpack_bytes(flavour: str, program, partitioner_kwargs) -> bytes:
    if flavour == "stock":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
            XnnpackPartitioner as StockPartitioner,
        )
        from executorch.exir import to_edge_transform_and_lower as stock_lower

        edge = stock_lower(program, partitioner=[StockPartitioner(**partitioner_kwargs)])
    else:
        from etfold.backends.xnnpack import XnnpackPartitioner
        from etfold.exir import to_edge_transform_and_lower

        edge = to_edge_transform_and_lower(
            program, partitioner=[XnnpackPartitioner(**partitioner_kwargs)]
        )
    return edge.to_executorch().buffer


def _xnnpack(build, flavour: str, partitioner_kwargs=None, dynamic_shapes=None, bounds_kept=False):
    def lower() -> list[bytes]:
        from etfold.exir import declared_bounds_kept
        from etfold.harness.modules import in_eval_mode

        module, inputs = build()
        shapes = dynamic_shapes() if dynamic_shapes else None
        program = torch.export.export(in_eval_mode(module), inputs, dynamic_shapes=shapes)
        with declared_bounds_kept() if bounds_kept else contextlib.nullcontext():
            return [_xnnpack_bytes(flavour, program, partitioner_kwargs or {})]

    return lower


def _arm_folds(flavour: str):
    if flavour == "stock":
        return contextlib.nullcontext()
    from etfold.backends.arm import arm_folds_registered

    return arm_folds_registered()


def _demo(name: str):
    from etfold.demo_models import load

    (model,) = load([e for e in catalogue() if e.name == name])
    return model


def _tosa(name: str, flavour: str):
    def lower() -> list[bytes]:
        from etfold.harness.tosa_runner import lower_tosa, quantize_for_tosa

        model = _demo(name)
        with _arm_folds(flavour):
            module, inputs = model.build()
            program = quantize_for_tosa(module, inputs, calibration=model.calibration())
            return [lower_tosa(program).edge.to_executorch().buffer]

    return lower


def _ethos_u(name: str, flavour: str, target: str):
    def lower() -> list[bytes]:
        from etfold.harness.vela import lower_module_ethos_u

        model = _demo(name)
        with _arm_folds(flavour):
            module, inputs = model.build()
            program = lower_module_ethos_u(module, inputs, target, calibration=model.calibration())
            return [program.edge.to_executorch().buffer]

    return lower


def _report_xnnpack(name: str, flavour: str):
    """The model's program and, when it has one, its fp32 twin's (the report lowers both)."""

    def lower() -> list[bytes]:
        model = _demo(name)
        builds = [model.build] + ([model.fp32_twin] if model.fp32_twin else [])
        kwargs = model.partitioner_kwargs
        return [b for build in builds for b in _xnnpack(build, flavour, kwargs)()]

    return lower


def _report_cases() -> list[Case]:
    from etfold.demo_models import BACKEND_REQUIRES

    cases = []
    for entry in catalogue():
        requires = (*BACKEND_REQUIRES.get(entry.backend, ()), *entry.requires)
        heavy = entry.name in HEAVY_REPORT_MODELS
        for flavour in ("stock", "etfold"):
            name = f"report {entry.name} {flavour}"
            if entry.backend != "arm":
                lower = _report_xnnpack(entry.name, flavour)
                cases.append(Case(name, "report xnnpack", heavy, lower, requires))
                continue
            lower = _tosa(entry.name, flavour)
            cases.append(Case(f"{name} tosa-int", "report arm", heavy, lower, requires))
            for target in ETHOS_U_TARGETS:
                lower = _ethos_u(entry.name, flavour, target)
                requires_vela = (*requires, "ethosu")
                cases.append(Case(f"{name} {target}", "report arm", heavy, lower, requires_vela))
    return cases


def _bench_cases() -> list[Case]:
    return [
        Case(
            f"bench {m.script} {m.name} {flavour}",
            "bench",
            m.script in HEAVY_BENCH_SCRIPTS or m.name in HEAVY_BENCH_MODELS,
            _xnnpack(
                m.build, flavour, m.partitioner_kwargs, m.dynamic_shapes, flavour in m.bounds_kept
            ),
            m.requires,
        )
        for m in bench_models()
        for flavour in m.flavours
    ]


def _llm_export(mode: str):
    def lower() -> list[bytes]:
        import tempfile

        from etfold.harness.bench_models import LLM_EXPORT_MAX_SEQ_LENGTH, llm_export_shape
        from etfold.harness.llama_export import (
            export_etfold,
            export_llama_arguments,
            write_model_files,
        )

        with tempfile.TemporaryDirectory() as workdir:
            params, checkpoint = write_model_files(llm_export_shape(), Path(workdir) / "model")
            output = Path(workdir) / f"{mode}.pte"
            arguments = export_llama_arguments(
                params, checkpoint, mode, output, LLM_EXPORT_MAX_SEQ_LENGTH
            )
            return [export_etfold(arguments)]

    return lower


def _llm_cases() -> list[Case]:
    from etfold.harness.bench_models import LLM_EXPORT_MODES

    return [
        Case(f"bench bench_llm_export export_llama {mode} etfold", "bench", True, _llm_export(mode))
        for mode in LLM_EXPORT_MODES
    ]


CASES = {c.name: c for c in (*_report_cases(), *_bench_cases(), *_llm_cases())}


def _check(case: Case) -> None:
    for module in case.requires:
        pytest.importorskip(module)
    programs = {}
    for speedups in (False, True):
        with lowering_speedups(speedups):
            programs[speedups] = case.lower()
    assert programs[True], case.name
    changed = [i for i, (a, b) in enumerate(zip(*programs.values(), strict=True)) if a != b]
    assert not changed, f"{case.name}: the speed-ups changed the bytes of program(s) {changed}"


@pytest.mark.long
@pytest.mark.parametrize("name", list(CASES))
def test_a_lowering_with_the_speedups_is_byte_identical_to_one_without(name):
    _check(CASES[name])


def rotation_turn() -> int:
    """`ETFOLD_SPEEDUPS_TURN`, else the number of commits, else the day of the year."""
    if os.environ.get(TURN_VARIABLE):
        return int(os.environ[TURN_VARIABLE])
    try:
        counted = subprocess.run(
            ["git", "-C", str(ROOT), "rev-list", "--count", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(counted.stdout)
    except (OSError, subprocess.CalledProcessError, ValueError):
        return datetime.date.today().timetuple().tm_yday


def rotating_sample(cases: list[Case], turn: int) -> list[str]:
    """Turn t's cases: the one at position t (cyclically) of each stratum's fixed shuffled
    order, so each stratum's cases come round one per turn."""
    strata: dict[str, list[str]] = {}
    for case in cases:
        strata.setdefault(case.stratum, []).append(case.name)
    picked = []
    for stratum, names in sorted(strata.items()):
        order = sorted(names)
        random.Random(stratum).shuffle(order)
        picked.append(order[turn % len(order)])
    return picked


LIGHT = [case for case in CASES.values() if not case.heavy]
TURN = rotation_turn()


@pytest.mark.parametrize("name", rotating_sample(LIGHT, TURN))
def test_a_rotating_sample_lowers_byte_identically_with_the_speedups(name, record_property):
    record_property(ROTATING_SAMPLE, f"{name} (turn {TURN}; {TURN_VARIABLE}={TURN} repeats it)")
    _check(CASES[name])


def test_the_rotation_covers_every_light_case_in_consecutive_turns():
    turns = max(Counter(case.stratum for case in LIGHT).values())
    covered = {n for turn in range(TURN, TURN + turns) for n in rotating_sample(LIGHT, turn)}
    assert covered == {case.name for case in LIGHT}
    assert rotating_sample(LIGHT, TURN) == rotating_sample(LIGHT[::-1], TURN)


def test_the_ethos_u_cases_are_the_reports_targets():
    pytest.importorskip("ethosu")
    from etfold.harness.vela import TARGETS

    assert TARGETS == ETHOS_U_TARGETS


def test_every_heavy_model_named_is_a_case():
    models = {e.name for e in catalogue()} | {m.name for m in bench_models()}
    assert models >= (HEAVY_REPORT_MODELS | HEAVY_BENCH_MODELS)
    assert {m.script for m in bench_models()} >= HEAVY_BENCH_SCRIPTS


def test_the_report_models_a_benchmark_lowers_are_report_cases():
    for script, models in REPORT_MODELS_LOWERED_BY_BENCH.items():
        for model in models:
            assert (
                f"report {model} etfold" in CASES or f"report {model} etfold tosa-int" in CASES
            ), (
                script,
                model,
            )
