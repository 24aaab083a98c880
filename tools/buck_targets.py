# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Write BUCK: one target per module (as ExecuTorch declares its passes), deps from imports.

Run `make buck` after adding or removing a Python file; it also reports import cycles,
which Buck rejects.
"""

import ast
import sys
from pathlib import Path

ROOT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
MAP = {"etfold": "etfold", "backends": "etfold.backends", "exir": "etfold.exir"}
EXT = {
    "torch": "//caffe2:torch",
    "executorch": "//executorch/exir:lib",
    "torchao": "fbsource//third-party/pypi/torchao:torchao",
    "numpy": "fbsource//third-party/pypi/numpy:numpy",
    "transformers": "fbsource//third-party/pypi/transformers:transformers",
    "tosa_reference_model": "fbsource//third-party/tosa_tools:tosa_reference_model",
    "tosa": "fbsource//third-party/tosa_tools:tosa",
    "pytest": "fbsource//third-party/pypi/pytest:pytest",
    "hypothesis": "fbsource//third-party/pypi/hypothesis:hypothesis",
}


def module_of(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = MAP[parts[0]]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def target_name(path):
    return (
        "_".join(path.relative_to(ROOT).with_suffix("").parts)
        .replace("__init__", "init")
        .replace("__", "_")
    )


def files(tree):
    return [p for p in sorted((ROOT / tree).rglob("*.py")) if "__pycache__" not in p.parts]


sources = [p for t in MAP for p in files(t)]
mod2file = {module_of(p): p for p in sources}


def deps_of(path):
    deps, ext = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for n in names:
            if n.startswith("etfold"):
                while n and n not in mod2file:
                    n = n.rpartition(".")[0]
                if n and mod2file[n] != path:
                    deps.add(":" + target_name(mod2file[n]))
            elif n.split(".")[0] in EXT:
                ext.add(EXT[n.split(".")[0]])
    return deps, ext


def fmt(xs):
    return "[]" if not xs else "[\n" + "".join(f'        "{x}",\n' for x in xs) + "    ]"


graph, out = (
    {},
    [
        'load("@fbsource//xplat/executorch/build:runtime_wrapper.bzl", "runtime")',
        "",
        'oncall("executorch")',
        "",
        "# One target per module, as ExecuTorch declares its passes. backends/ and exir/ import as",
        "# etfold.backends / etfold.exir (base_module); etfold/ imports as itself.",
        "",
    ],
)
for p in sources:
    deps, ext = deps_of(p)
    graph[":" + target_name(p)] = deps
    base = '    base_module = "etfold",\n' if p.relative_to(ROOT).parts[0] != "etfold" else ""
    out.append(
        f'runtime.python_library(\n    name = "{target_name(p)}",\n    srcs = ["{p.relative_to(ROOT)}"],\n{base}    deps = {fmt(sorted(deps) + sorted(ext))},\n    visibility = ["PUBLIC"],\n)\n'
    )
for p in files("test"):
    deps, ext = deps_of(p)
    kind = "python_test" if p.name.startswith("test_") else "python_library"
    out.append(
        f'runtime.{kind}(\n    name = "{target_name(p)}",\n    srcs = ["{p.relative_to(ROOT)}"],\n    deps = {fmt(sorted(deps) + sorted(ext))},\n)\n'
    )
for p in sorted((ROOT / "bench").glob("*.py")):
    deps, ext = deps_of(p)
    out.append(
        f'runtime.python_binary(\n    name = "{target_name(p)}",\n    srcs = ["{p.relative_to(ROOT)}"],\n    main_module = "bench.{p.stem}",\n    deps = {fmt(sorted(deps) + sorted(ext))},\n)\n'
    )
(ROOT / "BUCK").write_text("\n".join(out))
# cycle check
state = {}


def visit(n, stack):
    state[n] = 1
    for d in graph.get(n, ()):
        if state.get(d) == 1:
            print("CYCLE:", " -> ".join(stack + [n, d]))
            continue
        if d not in state:
            visit(d, stack + [n])
    state[n] = 2


for n in graph:
    if n not in state:
        visit(n, [])
print("libraries:", len(sources))
