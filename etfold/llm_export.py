# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""ExecuTorch's LLM export (`export_llama`) lowered with etfold's XNNPACK partitioners.

`executorch.examples.models.llama.export_llama_lib` asks one function for each of its
XNNPACK partitioners, `get_xnnpack_partitioner(dynamic_quant_only_partitioner,
enable_bf16)`, looked up by that name in its own module; neither the command line nor
`LlmConfig` can choose another. Inside `etfold_partitioners()` that name answers with
etfold's partitioners for the same arguments (`XnnpackDynamicallyQuantizedPartitioner`
for the quantized linears, `XnnpackPartitioner` for `--xnnpack-extended-ops`).

The speed-ups (same bytes, less work) are entered only around the pipeline's lowering
calls (`LOWERING_CALLS`: `to_edge_transform_and_lower` as the pipeline names it,
`to_backend`, `to_executorch`), never around its export, source transforms or
quantization: torch.export and dynamo trace the model on stock torch, as without etfold.

The pipeline asks for the two in that order and lowers with both, one after the other.
Run so, the first takes the linears alone and the second cannot join what it takes to
them: every linear is a delegate of its own, about eight per layer. So when the general
partitioner is asked for after the quantized one, the quantized one defers to it
(`DeferringDynamicallyQuantizedPartitioner`): the general partitioner, which has the
dynamically quantized configs too, takes the linears with their neighbours in one pass,
about one delegate per layer. Only the context that
entered sees this: another thread exporting meanwhile gets upstream's partitioners, and
when the last block ends the name is upstream's function again.

    python -m etfold.llm_export --model llama3 -c ckpt.pth -p params.json \\
        -kv --use_sdpa_with_kv_cache -X --xnnpack-extended-ops

takes export_llama's own arguments (`python -m executorch.examples.models.llama.export_llama`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
from collections.abc import Iterator, Sequence

from etfold.exir.program.reentrant_patch import PatchUnavailable, ReentrantPatch, Replacement

EXPORT_LLAMA_LIB = "executorch.examples.models.llama.export_llama_lib"
PARTITIONER_FACTORY = "get_xnnpack_partitioner"
LLM_BUILDER = "executorch.extension.llm.export.builder"
# (module, attribute path) of each call that lowers an exported program in the pipeline;
# the export (`LLMEdgeManager._export`) runs before and outside each of them
LOWERING_CALLS = (
    (LLM_BUILDER, "to_edge_transform_and_lower"),
    (EXPORT_LLAMA_LIB, "to_edge_transform_and_lower"),
    (LLM_BUILDER, "LLMEdgeManager.to_backend"),
    (LLM_BUILDER, "LLMEdgeManager.to_executorch"),
)


# the quantized-linear partitioner this context answered last, until a general one follows
_ASKED_FIRST: contextvars.ContextVar = contextvars.ContextVar(
    "etfold_llm_asked_first", default=None
)


def etfold_xnnpack_partitioner(
    dynamic_quant_only_partitioner: bool = True, enable_bf16: bool = False
):
    """etfold's answer to upstream's `get_xnnpack_partitioner`: the same choice of
    partitioner for the same arguments, made of etfold's classes; a general one asked
    for after a quantized one with the same bf16 setting takes over its work."""
    from etfold.backends.xnnpack import XnnpackPartitioner
    from etfold.backends.xnnpack.partition.deferring import (
        DeferringDynamicallyQuantizedPartitioner,
    )

    if dynamic_quant_only_partitioner:
        first = DeferringDynamicallyQuantizedPartitioner(enable_bf16=enable_bf16)
        _ASKED_FIRST.set(first)
        return first
    general = XnnpackPartitioner(enable_bf16=enable_bf16)
    first = _ASKED_FIRST.get()
    if first is not None and first._user_enable_bf16 == enable_bf16:
        first.defer_to(general)
    _ASKED_FIRST.set(None)
    return general


def _checked_factory(pipeline) -> None:
    """Refuse, before anything is replaced, an upstream factory that no longer takes the
    arguments etfold's answers to."""
    expected = list(inspect.signature(etfold_xnnpack_partitioner).parameters)
    found = list(inspect.signature(getattr(pipeline, PARTITIONER_FACTORY)).parameters)
    if found != expected:
        raise PatchUnavailable(
            f"{EXPORT_LLAMA_LIB}.{PARTITIONER_FACTORY} takes ({', '.join(found)}); etfold's"
            f" partitioners were written for ({', '.join(expected)})"
        )


def _sped_up(lowering):
    """`lowering`, each call inside etfold's lowering speed-ups."""
    from etfold.harness.lowering_speedups import lowering_speedups

    @functools.wraps(lowering)
    def call(*args, **kwargs):
        with lowering_speedups():
            return lowering(*args, **kwargs)

    return call


def _lowering_call(module: str, path: str) -> Replacement:
    owner = importlib.import_module(module)
    *owners, attribute = path.split(".")
    for name in owners:
        owner = getattr(owner, name, None)
    if owner is None:
        raise PatchUnavailable(f"{module}.{path} is gone")
    return Replacement(owner, attribute, _sped_up)


def _replacements() -> list[Replacement]:
    try:
        pipeline = importlib.import_module(EXPORT_LLAMA_LIB)
    except ImportError as error:
        raise PatchUnavailable(f"ExecuTorch's LLM export does not import: {error}") from None
    _checked_factory(pipeline)
    factory = Replacement(pipeline, PARTITIONER_FACTORY, lambda _: etfold_xnnpack_partitioner)
    return [factory, *(_lowering_call(module, path) for module, path in LOWERING_CALLS)]


PATCH = ReentrantPatch("llm_export_partitioners", _replacements)


@contextlib.contextmanager
def etfold_partitioners() -> Iterator[None]:
    """While entered, in this context, ExecuTorch's LLM export lowers with etfold's
    XNNPACK partitioners, and each of its lowering calls with etfold's speed-ups."""
    token = _ASKED_FIRST.set(None)
    try:
        with PATCH.scope():
            yield
    finally:
        _ASKED_FIRST.reset(token)


def export_llama(options: Sequence[str] | object) -> str:
    """`export_llama_lib.export_llama` with etfold's partitioners; returns the .pte path.

    `options` is export_llama's command line as a list of strings, or what upstream's
    `export_llama` takes (its parsed `argparse.Namespace`, an `LlmConfig`)."""
    pipeline = importlib.import_module(EXPORT_LLAMA_LIB)
    if isinstance(options, Sequence) and not isinstance(options, str):
        options = pipeline.build_args_parser().parse_args(list(options))
    with etfold_partitioners():
        return pipeline.export_llama(options)


def main() -> None:
    """Upstream's `export_llama` command on `sys.argv` (its seed, logging and Hydra mode
    included), lowered with etfold's partitioners."""
    # imported here: upstream's command module configures logging when imported
    command = importlib.import_module("executorch.examples.models.llama.export_llama")
    with etfold_partitioners():
        command.main()


if __name__ == "__main__":
    main()
