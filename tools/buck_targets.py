# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Write BUCK: one target per module (as ExecuTorch declares its passes), deps from imports.

Run `make buck` after adding or removing a Python file. Every import counts,
the ones inside functions (lazy) and relative ones included. An import cycle
between targets, which Buck rejects, is printed and the exit status is 1.
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


def _imported_names(path, module):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def deps_of(path, mod2file):
    deps, ext = set(), set()
    module = module_of(path) if path.parts[len(ROOT.parts)] in MAP else ""
    for n in _imported_names(path, module):
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


PREAMBLE = [
    'load("@fbsource//xplat/executorch/build:runtime_wrapper.bzl", "runtime")',
    "",
    'oncall("executorch")',
    "",
    "# One target per module, as ExecuTorch declares its passes. backends/ and exir/ import as",
    "# etfold.backends / etfold.exir (base_module); etfold/ imports as itself.",
    "",
]


def _target(kind, path, deps, extra="", public=False):
    srcs = path.relative_to(ROOT)
    visibility = '    visibility = ["PUBLIC"],\n' if public else ""
    return (
        f'runtime.{kind}(\n    name = "{target_name(path)}",\n    srcs = ["{srcs}"],\n'
        f"{extra}    deps = {fmt(sorted(deps[0]) + sorted(deps[1]))},\n{visibility})\n"
    )


def buck_file(sources, mod2file):
    """The BUCK text and the dependency graph of the library targets."""
    out, graph = list(PREAMBLE), {}
    for p in sources:
        deps = deps_of(p, mod2file)
        graph[":" + target_name(p)] = deps[0]
        base = '    base_module = "etfold",\n' if p.relative_to(ROOT).parts[0] != "etfold" else ""
        out.append(_target("python_library", p, deps, base, public=True))
    for p in files("test"):
        kind = "python_test" if p.name.startswith("test_") else "python_library"
        out.append(_target(kind, p, deps_of(p, mod2file)))
    for p in sorted((ROOT / "bench").glob("*.py")):
        main = f'    main_module = "bench.{p.stem}",\n'
        out.append(_target("python_binary", p, deps_of(p, mod2file), main))
    return "\n".join(out), graph


def cycles(graph):
    """Every import cycle found by a depth-first walk, as a path of targets."""
    state, found = {}, []

    def visit(node, stack):
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                found.append(stack + [node, dep])
            elif dep not in state:
                visit(dep, stack + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def main():
    sources = [p for t in MAP for p in files(t)]
    mod2file = {module_of(p): p for p in sources}
    text, graph = buck_file(sources, mod2file)
    (ROOT / "BUCK").write_text(text)
    found = cycles(graph)
    for cycle in found:
        print("CYCLE:", " -> ".join(cycle))
    print("libraries:", len(sources))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
