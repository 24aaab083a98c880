# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Across the report's XNNPACK models, no op outside a delegate is there unexplained.

Each op left outside a delegate either computes from a user input (directly or
through other ops, delegates included), so no fold could remove it, or is named
in a decline recorded during the lowering (a budget, or a reason). Every model
`etfold report --backend xnnpack` lowers is checked (its fp32 twins, llama's fp16
row, both gemma3 rows, the autocast decoders and the vocoder in `make test-long`), each lowered once
through etfold's entry point and partitioner, as the report does
(`lowered_demo`, whose lowering other test files read too; one worker runs them all).
"""

from __future__ import annotations

import pytest

from etfold.demo_models import catalogue, load
from etfold.harness.demo_lowerings import lowered_demo


def _same_build(build) -> tuple:
    """Two builders with the same code and captured values build the same model."""
    code = build.__code__
    captured = tuple(cell.cell_contents for cell in build.__closure__ or ())
    return code.co_code, code.co_consts, code.co_names, captured


# The llama decoder in bf16 in `make test` (the row other files of the group read too);
# in `make test-long`: its fp16 row, both gemma3 rows, the autocast decoder and block
# (each a decoder lowering no other short test reads; the llama row is a bf16 decoder with
# fp32 <-> bf16 converts too, test_inline_autocast_regions_pass inlines the regions), the explicit
# bf16 decoder (the llama row is an explicit bf16 decoder too) and the weight_norm vocoder
# (wav2vec2_pos_conv's row folds weight_norm convs, test_fuzz_weight_fold transposed ones).
LONG_ROWS = {
    "gemma3_tiny_bf16",
    "gemma3_tiny_fp16",
    "llama_tiny_fp16",
    "decoder_autocast_bf16",
    "decoder_block_autocast_bf16",
    "decoder_explicit_bf16",
    "speecht5_hifigan_small",
}


def _cases() -> list:
    """Every XNNPACK report row, and each distinct fp32 twin the report lowers beside them."""
    entries = [e for e in catalogue() if e.backend == "xnnpack"]
    cases, twins = [], set()
    for entry, model in zip(entries, load(entries), strict=True):
        missing = entry.missing()
        marks = [pytest.mark.skip(reason=f"needs {', '.join(missing)}")] if missing else []
        row_marks = [*marks, pytest.mark.long] if model.name in LONG_ROWS else marks
        cases.append(pytest.param(model.name, False, id=model.name, marks=row_marks))
        if model.fp32_twin is not None and _same_build(model.fp32_twin) not in twins:
            twins.add(_same_build(model.fp32_twin))
            twin_id = f"{model.name}-fp32_twin"
            twin_marks = [*marks, pytest.mark.long]  # fp32 graphs: the rows' own cover their ops
            cases.append(pytest.param(model.name, True, id=twin_id, marks=twin_marks))
    return cases


@pytest.mark.parametrize("name, fp32_twin", _cases())
def test_every_op_outside_a_delegate_reads_a_user_input_or_was_declined(name, fp32_twin):
    lowering = lowered_demo(name, fp32_twin)
    declined = {d.where for d in lowering.decisions if not d.applied}
    unexplained = [
        f"{node} ({op})"
        for node, op in lowering.program.constant_work_outside()
        if node not in declined
    ]
    assert unexplained == []
