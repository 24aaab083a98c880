# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The layers of CONTRIBUTING.md ("The shape of the code"): a module imports only
from its own layer or the layers below it, lazy imports inside functions included.
Beside the layers: `exir/` never imports a backend (backends plug into its
registries), sibling backends never import each other, and `tools/` and
`bench/` never import from `test/`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("backends", "exir", "etfold", "tools", "bench")
BACKENDS = ("etfold.backends.arm", "etfold.backends.xnnpack")

# (layer, module prefixes), lowest first; the longest matching prefix decides.
LAYERS = (
    (
        "toolkit",
        (
            "etfold.decisions",
            "etfold.versions",
            "etfold.exir.passes.graph_walk",
            "etfold.exir.program.working_copy",
            "etfold.exir.program.reentrant_patch",
            "etfold.backends.arm._passes.op_families",
            "etfold.backends.arm._passes.constants",
            "etfold.backends.arm._passes.twin_layers",
            "etfold.backends.arm._passes.fake_values",
            "etfold.backends.arm._passes.channel_vectors",
            "etfold.backends.arm._passes.conv_arguments",
            "etfold.backends.arm._passes.layout_axes",
            "etfold.exir.passes.node_shapes",
            "etfold.backends.arm._passes.tosa_integer",
        ),
    ),
    (
        "exir passes",
        (
            "etfold.exir.passes",
            "etfold.exir.emit",
            "etfold.exir.program.buffer_marks",
            "etfold.exir.program.method_marks",
        ),
    ),
    (
        "backend passes",
        (
            "etfold.backends.arm._passes",
            "etfold.backends.xnnpack._passes",
            "etfold.backends.xnnpack.partition",
            "etfold.backends.xnnpack.operators",
        ),
    ),
    (
        "entry points",
        (
            "etfold.exir",
            "etfold.backends",
            "etfold.backends.xnnpack.partition.xnnpack_partitioner",
            "etfold.backends.xnnpack.partition.dynamically_quantized",
            "etfold.backends.xnnpack.partition.deferring",
            "etfold.backends.xnnpack.install",
            "etfold.backends.arm.registration",
        ),
    ),
    ("cli and harness", ("etfold",)),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts if parts[0] == "etfold" else ["etfold", *parts])


def layer_of(module: str) -> int | None:
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), rank)
    return None if best is None else best[1]


def _imports(path: Path, module: str) -> set[str]:
    return {name for name in _all_imports(path, module) if name.startswith("etfold.")}


def _all_imports(path: Path, module: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.rsplit(".", node.level)[0]
                found.add(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _sources():
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def test_every_module_imports_only_its_layer_and_below():
    upward = []
    for path in _sources():
        module = _module_name(path)
        own = layer_of(module)
        for imported in _imports(path, module):
            theirs = layer_of(imported)
            if own is not None and theirs is not None and theirs > own:
                upward.append(
                    f"{module} ({LAYERS[own][0]}) imports {imported} ({LAYERS[theirs][0]})"
                )
    assert not upward, "\n".join(upward)


def test_every_module_has_a_layer():
    assert all(layer_of(_module_name(path)) is not None for path in _sources())


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_exir_imports_no_backend():
    found = [
        f"{module} imports {imported}"
        for path in sorted((ROOT / "exir").rglob("*.py"))
        for module in [_module_name(path)]
        for imported in _imports(path, module)
        if _within(imported, "etfold.backends")
    ]
    assert not found, "\n".join(found)


def test_sibling_backends_never_import_each_other():
    found = []
    for path in sorted((ROOT / "backends").rglob("*.py")):
        module = _module_name(path)
        own = next((b for b in BACKENDS if _within(module, b)), None)
        for imported in _imports(path, module):
            theirs = next((b for b in BACKENDS if _within(imported, b)), None)
            if own is not None and theirs is not None and theirs != own:
                found.append(f"{module} imports {imported}")
    assert not found, "\n".join(found)


def _test_modules() -> set[str]:
    return {"test"} | {p.stem for p in (ROOT / "test").rglob("*.py") if p.stem != "__init__"}


def test_tools_and_bench_import_nothing_from_test():
    test_modules, found = _test_modules(), []
    for package in ("tools", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            module = _module_name(path)
            for imported in _all_imports(path, module):
                if imported.split(".")[0] in test_modules:
                    found.append(f"{path.relative_to(ROOT)} imports {imported}")
            for line in path.read_text().splitlines():
                if "sys.path" in line and "test" in line:
                    found.append(f"{path.relative_to(ROOT)} puts test/ on sys.path")
    assert not found, "\n".join(found)
