# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Built-in models for `etfold report`.

Each module in this package defines `MODELS: list[DemoModel]`; adding a model
is adding a module, with nothing else to touch.

`catalogue()` reads the names, backends and descriptions from the modules'
source without importing them (no torch), so `etfold report --list` and
argument checks stay instant; `load()` imports only the modules it needs.
A model whose `DemoModel(...)` call is not written with literal strings is
still found: its module is then imported.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from etfold.demo_models.base import DemoModel

# backend -> Python modules its lowering and runtime need
BACKEND_REQUIRES = {"xnnpack": (), "arm": ("tosa_serializer", "tosa_reference_model")}
# optional module -> the etfold extra that installs it
EXTRA_FOR_MODULE = {
    "tosa_serializer": "arm",
    "tosa_reference_model": "arm",
    "transformers": "report",
}


@dataclass(frozen=True)
class CatalogueEntry:
    name: str
    backend: str
    description: str
    module: str  # the module of this package defining it
    requires: tuple[str, ...] = ()  # Python modules it needs beyond the core dependencies
    default: bool = False  # in the set a plain `etfold report` runs

    def missing(self) -> tuple[str, ...]:
        needed = (*BACKEND_REQUIRES.get(self.backend, ()), *self.requires)
        return tuple(m for m in needed if importlib.util.find_spec(m) is None)

    def missing_extras(self) -> tuple[str, ...]:
        return tuple(sorted({EXTRA_FOR_MODULE.get(m, m) for m in self.missing()}))


def __getattr__(name: str):
    if name == "DemoModel":  # lazily: base imports torch
        from etfold.demo_models.base import DemoModel

        return DemoModel
    raise AttributeError(name)


def _model_modules() -> list[str]:
    return [i.name for i in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name)]


def _literal_entries(module: str) -> list[CatalogueEntry] | None:
    """The module's MODELS read from its source, or None when it is not all literals."""
    tree = ast.parse((Path(__file__).parent / f"{module}.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        if getattr(node.targets[0], "id", None) != "MODELS":
            continue
        if not isinstance(node.value, ast.List):
            return None
        entries = []
        for call in node.value.elts:
            try:
                entries.append(_entry_from_call(call, module))
            except (ValueError, TypeError, IndexError):
                return None
        return entries
    return None


def _entry_from_call(call: ast.expr, module: str) -> CatalogueEntry:
    if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "DemoModel"):
        raise ValueError("not a DemoModel(...) call")
    name, backend = (ast.literal_eval(a) for a in call.args[:2])
    keywords = {k.arg: k.value for k in call.keywords}
    description = ast.literal_eval(call.args[3] if len(call.args) > 3 else keywords["description"])
    requires = tuple(ast.literal_eval(keywords["requires"])) if "requires" in keywords else ()
    default = ast.literal_eval(keywords["default"]) if "default" in keywords else False
    if not isinstance(default, bool):
        raise TypeError("default must be a literal bool")
    return CatalogueEntry(name, backend, description, module, requires, default)


def _imported_entries(module: str) -> list[CatalogueEntry]:
    imported = importlib.import_module(f"{__name__}.{module}")
    return [
        CatalogueEntry(m.name, m.backend, m.description, module, tuple(m.requires), m.default)
        for m in imported.MODELS
    ]


def catalogue() -> list[CatalogueEntry]:
    entries: list[CatalogueEntry] = []
    for module in _model_modules():
        if module == "base":
            continue
        literal = _literal_entries(module)
        entries.extend(literal if literal is not None else _imported_entries(module))
    names = [e.name for e in entries]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"demo model names must be unique: {duplicated}")
    return entries


def load(entries: list[CatalogueEntry]) -> list[DemoModel]:
    """The DemoModel of each entry, importing only their modules."""
    by_module = {}
    for module in dict.fromkeys(e.module for e in entries):
        imported = importlib.import_module(f"{__name__}.{module}")
        by_module[module] = {m.name: m for m in imported.MODELS}
    return [by_module[e.module][e.name] for e in entries]


def all_models() -> list[DemoModel]:
    return load(catalogue())
