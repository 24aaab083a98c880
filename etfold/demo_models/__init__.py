"""Built-in models for `etfold report`.

Each module in this package defines `MODELS: list[DemoModel]`; adding a model
is adding a module, with nothing else to touch.
"""

from __future__ import annotations

import importlib
import pkgutil

from etfold.demo_models.base import DemoModel


def all_models() -> list[DemoModel]:
    models: list[DemoModel] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        models.extend(module.MODELS)
    names = [m.name for m in models]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"demo model names must be unique: {duplicated}")
    return models
