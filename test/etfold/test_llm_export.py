# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""ExecuTorch's LLM export with etfold's partitioners (`etfold.llm_export`).

The scope: inside it, and only in the context that entered it, export_llama's
partitioner requests get etfold's partitioners; afterwards upstream's function is
back. The export: a tiny llama3-style model (dim 64, 1 layer, 4 heads / 2 KV
heads, vocab 256, random Meta-format checkpoint, a KV cache of 16 positions)
exported by upstream's `export_llama` and by etfold's, each .pte run on the XNNPACK
runtime: prefill of 8 tokens, then one decode step, outputs equal.
"""

from __future__ import annotations

import importlib
import threading

import pytest
import torch
from executorch.backends.xnnpack.partition import xnnpack_partitioner as upstream

from etfold.backends.xnnpack import XnnpackDynamicallyQuantizedPartitioner, XnnpackPartitioner
from etfold.exir.program.reentrant_patch import PatchUnavailable
from etfold.exir.program.speedups import active_speedups, every_speedup
from etfold.harness.llama_export import (
    TINY,
    export_etfold,
    export_llama_arguments,
    export_stock,
    ops_outside,
    prefill_then_decode,
    pte_contents,
    write_model_files,
)
from etfold.llm_export import (
    EXPORT_LLAMA_LIB,
    LLM_BUILDER,
    PARTITIONER_FACTORY,
    etfold_partitioners,
)

PROMPT = torch.randint(0, TINY.vocab_size, (1, 8), generator=torch.Generator().manual_seed(3))
NEXT_TOKEN = 17
MAX_SEQ_LENGTH = 16  # the prompt and one decoded token fit


@pytest.fixture(scope="module")
def pipeline():
    return importlib.import_module(EXPORT_LLAMA_LIB)


def test_partitioner_requests_get_etfolds_partitioners_inside_the_scope(pipeline):
    original = vars(pipeline)[PARTITIONER_FACTORY]
    with etfold_partitioners():
        dynamic = pipeline.get_xnnpack_partitioner(dynamic_quant_only_partitioner=True)
        extended = pipeline.get_xnnpack_partitioner(False, enable_bf16=True)
    assert isinstance(dynamic, XnnpackDynamicallyQuantizedPartitioner)
    assert type(extended) is XnnpackPartitioner
    assert extended._user_enable_bf16 is True
    assert dynamic.deferred_to is None  # another bf16 setting: not the same lowering
    assert vars(pipeline)[PARTITIONER_FACTORY] is original
    assert (
        type(pipeline.get_xnnpack_partitioner(True))
        is upstream.XnnpackDynamicallyQuantizedPartitioner
    )


def test_the_quantized_partitioner_defers_to_a_general_one_asked_for_after_it(pipeline):
    with etfold_partitioners():
        alone = pipeline.get_xnnpack_partitioner(True)
        first = pipeline.get_xnnpack_partitioner(True)
        general = pipeline.get_xnnpack_partitioner(False)
        later = pipeline.get_xnnpack_partitioner(False)
    assert alone.deferred_to is None and first.deferred_to is general
    assert later is not general


def test_a_deferring_partitioner_takes_nothing_and_its_successor_takes_the_linears():
    from executorch.exir import to_edge_transform_and_lower as upstream_lower

    from etfold.backends.xnnpack.partition.deferring import (
        DeferringDynamicallyQuantizedPartitioner,
    )
    from etfold.harness.xnnpack_runner import assert_close, eager_outputs, load_program

    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.SiLU(), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)
    ).eval()
    x = torch.randn(2, 8)

    def lowered(defer: bool):
        first, general = DeferringDynamicallyQuantizedPartitioner(), XnnpackPartitioner()
        if defer:
            first.defer_to(general)
        program = torch.export.export(model, (x,))
        return upstream_lower(program, partitioner=[first, general]).to_executorch()

    programs = {defer: lowered(defer) for defer in (False, True)}
    calls = {defer: _delegate_calls(program) for defer, program in programs.items()}
    assert calls == {False: 4, True: 1}  # each linear, the SiLU and the norm alone; all in one
    runtime = load_program(programs[True])
    assert_close(list(runtime.run_method("forward", (x,))), eager_outputs(model, (x,)), atol=1e-5)


def _delegate_calls(executorch) -> int:
    return sum(
        1
        for node in executorch.exported_program().graph.nodes
        if node.target is torch.ops.higher_order.executorch_call_delegate
    )


def test_another_thread_gets_upstreams_partitioners_meanwhile(pipeline):
    seen = []
    with etfold_partitioners():
        worker = threading.Thread(
            target=lambda: seen.append(pipeline.get_xnnpack_partitioner(False))
        )
        worker.start()
        worker.join()
        seen.append(pipeline.get_xnnpack_partitioner(False))
    assert [type(p) for p in seen] == [upstream.XnnpackPartitioner, XnnpackPartitioner]


def test_the_scope_is_undone_when_the_export_raises(pipeline, tmp_path):
    from etfold.llm_export import export_llama

    original = vars(pipeline)[PARTITIONER_FACTORY]
    with pytest.raises(FileNotFoundError):
        export_llama(["--model", "llama3", "-c", str(tmp_path / "missing.pth"), "-X"])
    assert vars(pipeline)[PARTITIONER_FACTORY] is original


def test_declines_a_partitioner_factory_that_takes_other_arguments(pipeline, monkeypatch):
    def other_factory(dynamic_quant_only_partitioner=True, enable_bf16=False, enable_fp16=False):
        raise AssertionError("not called")

    monkeypatch.setattr(pipeline, PARTITIONER_FACTORY, other_factory)
    with pytest.raises(PatchUnavailable, match="enable_fp16"), etfold_partitioners():
        pass
    assert vars(pipeline)[PARTITIONER_FACTORY] is other_factory


def test_the_pipeline_exports_on_stock_torch_and_lowers_with_the_speedups(pipeline, monkeypatch):
    """Inside the scope, the pipeline's torch.export calls (dynamo tracing the model, then
    its pre-autograd graph again) see none of etfold's speed-ups; its lowering calls see
    all of them."""
    monkeypatch.setenv("ETFOLD_SPEEDUPS", "1")
    builder = importlib.import_module(LLM_BUILDER)
    seen: dict[str, list] = {"export": [], "lower": [], "to_executorch": []}

    def spy(name, function):
        def call(*args, **kwargs):
            seen[name].append(active_speedups())
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(builder, "export", spy("export", builder.export))
    lower = spy("lower", builder.to_edge_transform_and_lower)
    monkeypatch.setattr(builder, "to_edge_transform_and_lower", lower)
    to_executorch = builder.EdgeProgramManager.to_executorch
    monkeypatch.setattr(
        builder.EdgeProgramManager, "to_executorch", spy("to_executorch", to_executorch)
    )
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.SiLU()).eval()
    with etfold_partitioners():
        partitioner = pipeline.get_xnnpack_partitioner(False)
        manager = builder.LLMEdgeManager(model, "tiny", 8, False, (torch.randn(2, 8),))
        manager.export().to_edge_transform_and_lower([partitioner]).to_executorch()
    everything = [patch.name for patch in every_speedup()]
    assert seen == {"export": [[], []], "lower": [everything], "to_executorch": [everything]}
    assert active_speedups() == []


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    return write_model_files(TINY, tmp_path_factory.mktemp("tiny_llama"))


def _exports(model_files, tmp_path, mode: str) -> dict[str, bytes]:
    params, checkpoint = model_files
    return {
        flavour: export(
            export_llama_arguments(
                params, checkpoint, mode, tmp_path / f"{flavour}.pte", MAX_SEQ_LENGTH
            )
        )
        for flavour, export in (("stock", export_stock), ("etfold", export_etfold))
    }


# (mode, absolute tolerance on logits of size ~1): fp32 programs differ only in how
# exact rewrites order their sums; bf16 ones round intermediates in different places
MODES = [
    pytest.param("fp32", 1e-4, id="fp32"),
    pytest.param("8da4w", 1e-4, id="8da4w", marks=pytest.mark.long),
    pytest.param("bf16", 0.1, id="bf16", marks=pytest.mark.long),
]


@pytest.mark.parametrize("mode,atol", MODES)
def test_export_llama_with_etfold_runs_like_stock(model_files, tmp_path, mode, atol):
    programs = _exports(model_files, tmp_path, mode)
    stock, etfold = (pte_contents(programs[f]) for f in ("stock", "etfold"))
    if mode == "bf16":  # the quantized partitioner does not defer in bf16 programs
        assert etfold.delegate_calls <= stock.delegate_calls
    else:  # one delegate per layer, one after the last norm, one for the output head
        assert etfold.delegate_calls <= TINY.n_layers + 2 < stock.delegate_calls
    assert set(ops_outside(etfold)) <= set(ops_outside(stock))

    expected = prefill_then_decode(programs["stock"], PROMPT, NEXT_TOKEN)
    outputs = prefill_then_decode(programs["etfold"], PROMPT, NEXT_TOKEN)
    assert [o.shape for o in outputs] == [(1, TINY.vocab_size)] * 2
    for ours, theirs in zip(outputs, expected, strict=True):
        torch.testing.assert_close(ours.float(), theirs.float(), atol=atol, rtol=0)
