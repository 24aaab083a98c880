# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""README.md as a newcomer reads it: the quick start runs as written, and the text stays
short (no sentence over 40 words, no table cell over 30)."""

import re
from pathlib import Path

import torch

from etfold import collect_decisions

README = Path(__file__).resolve().parents[1] / "README.md"


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def quick_start_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", _section(README.read_text(), "Quick start"), re.S)


def _prose(text: str) -> str:
    """The README without code blocks, table rows and headings."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    lines = [line for line in text.splitlines() if not line.startswith(("|", "#"))]
    return "\n".join(lines)


def _words(text: str) -> int:
    return len(re.findall(r"[\w`'.,/*()+-]+", text))


def test_the_quick_start_has_an_xnnpack_and_an_arm_block():
    blocks = quick_start_blocks()
    assert len(blocks) == 2
    assert "XnnpackPartitioner" in blocks[0] and "register_arm_folds()" in blocks[1]


def test_no_sentence_over_40_words_and_no_table_cell_over_30():
    text = README.read_text()
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z`(])|\n\s*\n|\n- ", _prose(text))
    long = [s for s in sentences if _words(s) > 40]
    assert not long, long
    cells = [c for line in text.splitlines() if line.startswith("|") for c in line.split("|")]
    wide = [c for c in cells if _words(c) > 30]
    assert not wide, wide


def test_xnnpack_quick_start_writes_a_pte_that_matches_eager(tmp_path, monkeypatch):
    from executorch.runtime import Runtime

    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    with collect_decisions() as decisions:
        exec(compile(quick_start_blocks()[0], "README.md (XNNPACK)", "exec"), namespace)
    assert any(d.applied and d.fold == "xnnpack.fold_gemm_weight" for d in decisions)
    buffer = (tmp_path / "model.pte").read_bytes()
    program = Runtime.get().load_program(buffer)
    (actual,) = program.load_method("forward").execute(namespace["inputs"])
    with torch.no_grad():
        expected = namespace["model"](*namespace["inputs"])
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def _delegate_payloads(buffer: bytes, backend_id: str) -> list[bytes]:
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(buffer).program
    (plan,) = program.execution_plan
    return [
        program.backend_delegate_data[d.processed.index].data
        for d in plan.delegates
        if d.id == backend_id
    ]


def test_arm_quick_start_folds_the_scale_into_the_conv(tmp_path, monkeypatch):
    from etfold.backends.arm import arm_folds_registered
    from etfold.harness.inspection import tosa_operator_counts

    monkeypatch.chdir(tmp_path)
    with arm_folds_registered(), collect_decisions() as decisions:  # left as it was found
        exec(compile(quick_start_blocks()[1], "README.md (Arm)", "exec"), {})
    assert any(d.applied and d.fold == "arm.scalar_mul_into_conv" for d in decisions)
    (graph,) = _delegate_payloads((tmp_path / "model_tosa.pte").read_bytes(), "TOSABackend")
    operators = tosa_operator_counts(graph)
    assert operators["CONV2D"] == 1 and operators["MUL"] == 0, operators
