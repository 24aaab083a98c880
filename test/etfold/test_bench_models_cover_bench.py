# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Every bench/*.py that lowers with XNNPACK lowers programs of the registry.

A script lowers with XNNPACK when its code names an XNNPACK lowering call
(`XNNPACK_LOWERING`): its own code, or the code it carries in a string for a child
process to run (docstrings and comments are prose, not code). Each such script is the `script` of
a `bench_models()` entry, or lowers only report models
(`REPORT_MODELS_LOWERED_BY_BENCH`, which test_speedups_on_what_users_lower.py
lowers as report cases). Each script that lowers nothing with XNNPACK is named, with
why, in `LOWERS_NOTHING_WITH_XNNPACK`, and every script is in one of the three: a new
benchmark is placed by whoever writes it. Nothing here lowers.
"""

from __future__ import annotations

import ast
import contextlib
import functools
from pathlib import Path

from etfold.harness.bench_models import REPORT_MODELS_LOWERED_BY_BENCH, bench_models

BENCH = Path(__file__).resolve().parents[2] / "bench"

# upstream's and etfold's entry point and partitioner, and the harness's helpers that
# call them (etfold.harness.xnnpack_runner, dynamic_shapes, dynamic_pairs, demo_lowerings)
XNNPACK_LOWERING = frozenset(
    {
        "to_edge_transform_and_lower",
        "XnnpackPartitioner",
        "lower_xnnpack",
        "lower_module_xnnpack",
        "lower_dynamic",
        "lower_with_decisions",
        "lower_static_and_dynamic",
        "lower_xnnpack_pair",
        "lowered_demo",
    }
)

LOWERS_NOTHING_WITH_XNNPACK = {
    # quantizes the Arm report models for TOSA INT and the Ethos-U NPUs and lowers them
    # through the Arm backend (Vela's cycle estimates, the TOSA reference model)
    "bench_arm_npu",
    # runs constant_prop_pass on an Edge program made by `to_edge`: no partitioner
    "bench_constant_prop",
    # times the `etfold` command's start-up (`--help`, `report --list`) in fresh processes
    "bench_cli_startup",
}


def scripts() -> dict[str, Path]:
    return {path.stem: path for path in sorted(BENCH.glob("*.py"))}


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the module's, classes' and functions' docstring constants."""
    found = set()
    for node in ast.walk(tree):
        documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, documented) and node.body and isinstance(node.body[0], ast.Expr):
            found.add(id(node.body[0].value))
    return found


def names_in_code(source: str) -> set[str]:
    """Every name the code uses, reads as an attribute or imports, in `source` and in each
    string of it that parses as Python."""
    tree = ast.parse(source)
    prose, names = docstrings(tree), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.name.rsplit(".", 1)[-1])
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
        ):
            with contextlib.suppress(SyntaxError, ValueError):
                names |= names_in_code(node.value)
    return names


@functools.cache
def lowering_with_xnnpack() -> frozenset[str]:
    return frozenset(
        name
        for name, path in scripts().items()
        if names_in_code(path.read_text()) & XNNPACK_LOWERING
    )


REGISTERED = {m.script for m in bench_models()}


def test_every_script_lowering_with_xnnpack_has_its_programs_registered():
    unregistered = lowering_with_xnnpack() - REGISTERED - set(REPORT_MODELS_LOWERED_BY_BENCH)
    assert not unregistered, (
        f"{sorted(unregistered)} lower with XNNPACK but no program of theirs is in "
        "etfold.harness.bench_models: register them there and build from the registry"
    )


def test_every_registered_script_is_seen_lowering_with_xnnpack():
    # the scan's own check: each script the registry names is one it recognises
    assert lowering_with_xnnpack() >= REGISTERED


def test_the_scan_reads_code_not_prose():
    source = '''"""Lowered with to_edge_transform_and_lower."""
# lower_xnnpack(program)
PROBE = "from etfold.exir import to_edge_transform_and_lower"
'''
    names = names_in_code(source)
    assert "to_edge_transform_and_lower" in names
    assert "lower_xnnpack" not in names
    assert not names_in_code('"""to_edge_transform_and_lower(p)"""') & XNNPACK_LOWERING


def test_a_script_said_to_lower_nothing_names_no_xnnpack_lowering():
    assert not LOWERS_NOTHING_WITH_XNNPACK & lowering_with_xnnpack()
    assert not LOWERS_NOTHING_WITH_XNNPACK & (REGISTERED | set(REPORT_MODELS_LOWERED_BY_BENCH))


def test_every_script_is_registered_lowers_report_models_or_lowers_nothing():
    placed = REGISTERED | set(REPORT_MODELS_LOWERED_BY_BENCH) | LOWERS_NOTHING_WITH_XNNPACK
    assert set(scripts()) == placed
