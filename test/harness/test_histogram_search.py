# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The histogram search on numbers chooses torchao's min/max, and leaves torchao as it was."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchao.quantization.pt2e.observer import HistogramObserver

from etfold.harness.histogram_search import histogram_search_on_numbers, search_min_max
from etfold.harness.tosa_runner import quantize_exported, tosa_quantizer


def _observer(batches: list[torch.Tensor]) -> HistogramObserver:
    observer = HistogramObserver(
        dtype=torch.int8, qscheme=torch.per_tensor_symmetric, quant_min=-128, quant_max=127
    )
    for batch in batches:
        observer(batch)
    return observer


def _assert_same_choice(observer: HistogramObserver) -> None:
    theirs = observer._non_linear_param_search()
    ours = search_min_max(observer)
    assert all(torch.equal(a, b) for a, b in zip(theirs, ours, strict=True)), (theirs, ours)


def _normal(seed: int, scale: float = 1.0, shape=(2, 8, 6, 6)) -> torch.Tensor:
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "batches",
    [
        [_normal(0)],
        [torch.tanh(_normal(1, 3.0)), torch.tanh(_normal(2))],  # bounded, mass at both ends
        [_normal(3).relu(), _normal(4, 5.0).relu()],  # half the mass in the zero bin
        [torch.cat([_normal(5).flatten(), torch.tensor([40.0, -35.0])])],  # far outliers
        [torch.full((4, 4), 0.25)],  # one value: no width to search
        [torch.linspace(-1, 1, 4097)],  # uniform: the error falls all the way
    ],
    ids=["normal", "tanh", "relu", "outliers", "constant", "uniform"],
)
def test_chooses_torchaos_min_max(batches):
    _assert_same_choice(_observer(batches))


@settings(max_examples=25, deadline=None)
@given(
    seeds=st.lists(st.integers(0, 2**16), min_size=1, max_size=3),
    scale=st.floats(1e-3, 1e3),
    skew=st.floats(-2.0, 2.0),
    size=st.integers(1, 600),
)
def test_generated_observations_choose_torchaos_min_max(seeds, scale, skew, size):
    batches = [
        scale * (_normal(seed, shape=(size,)) + skew * _normal(seed + 1, shape=(size,)).abs())
        for seed in seeds
    ]
    _assert_same_choice(_observer(batches))


def test_the_scope_patches_torchao_only_while_open():
    torchaos = HistogramObserver.__dict__["_non_linear_param_search"]
    observer = _observer([_normal(3), _normal(4, scale=2.0)])
    with histogram_search_on_numbers():
        with histogram_search_on_numbers():
            assert HistogramObserver.__dict__["_non_linear_param_search"] is not torchaos
        chosen = observer._non_linear_param_search()
    assert all(torch.equal(a, b) for a, b in zip(chosen, search_min_max(observer), strict=True))
    assert HistogramObserver.__dict__["_non_linear_param_search"] is torchaos


def test_a_quantized_program_is_the_one_torchaos_search_gives():
    """End to end: the Arm quantizer's program, converted inside the scope and outside it."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.Tanh(), torch.nn.Conv2d(4, 2, 1)
    ).eval()
    samples = [(_normal(seed, shape=(1, 3, 8, 8)),) for seed in range(3)]
    exported = torch.export.export(module, samples[0])
    ours = quantize_exported(exported, tosa_quantizer(), samples[0], samples[1:])

    prepared = prepare_pt2e(copy.deepcopy(exported).module(check_guards=False), tosa_quantizer())
    with torch.no_grad():
        for sample in samples:
            prepared(*sample)
    theirs = torch.export.export(convert_pt2e(prepared), samples[0])
    assert ours.graph_module.code == theirs.graph_module.code
    for name, value in theirs.state_dict.items():
        assert torch.equal(ours.state_dict[name], value)
    scales = [n.args[1:3] for n in ours.graph.nodes if "quantize_per_tensor" in str(n.target)]
    assert scales == [
        n.args[1:3] for n in theirs.graph.nodes if "quantize_per_tensor" in str(n.target)
    ]
    assert len(scales) >= 3
