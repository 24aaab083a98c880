# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Upstream attributes etfold's Arm registration replaces, and the one way they are restored.

`replace` stores the attribute exactly as the owner's `__dict__` holds it (a
staticmethod stays one) next to what replaced it; `restore` puts every stored
original back, last replaced first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Replaced:
    owner: object  # a class or a module
    attribute: str
    original: object


def replace(owner: object, attribute: str, make: Callable[[object], object]) -> Replaced:
    """`owner.attribute = make(original)`; returns what `restore` needs to undo it."""
    original = owner.__dict__[attribute]
    setattr(owner, attribute, make(original))
    return Replaced(owner, attribute, original)


def restore(replaced: list[Replaced]) -> None:
    """Put back every original, last replaced first."""
    for entry in reversed(replaced):
        setattr(entry.owner, entry.attribute, entry.original)
