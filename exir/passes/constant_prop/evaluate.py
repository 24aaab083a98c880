# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Evaluate: each selected node's value, computed once, in graph order, without grad.

    v(n) = n.target(v(a_1), ..., v(a_k))      v(source) = the stored tensor

An op that raises, or returns something a program cannot hold as a constant
(a string, an opaque object), stays an op with the reason recorded; the nodes
that read it stay ops too. Stored results are detached and contiguous, and
share storage with no source and no other result (`fresh_constant`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from etfold.decisions import Declined, record_declined
from etfold.exir.passes.constant_prop import FOLD
from etfold.exir.passes.constant_prop.select import Selection
from etfold.exir.passes.graph_walk import is_plain_tensor


@dataclass(frozen=True)
class Evaluation:
    """The value of every source and folded node; the folded nodes in graph order."""

    values: Mapping[torch.fx.Node, Any]
    folded: tuple[torch.fx.Node, ...]


def _is_foldable_value(value) -> bool:
    if is_plain_tensor(value):
        return True
    if isinstance(value, (bool, int, float)):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain_tensor(v) or v is None for v in value)
    return False


def evaluate(node: torch.fx.Node, values: Mapping[torch.fx.Node, Any]):
    """`node`'s value from its inputs' values, or a Declined."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: values[n])
    try:
        with torch.no_grad():
            result = node.target(*args, **kwargs)
    except Exception as error:  # fail closed: an op that cannot run here stays an op
        return Declined(f"evaluation raised {type(error).__name__}: {error}")
    if not _is_foldable_value(result):
        return Declined(f"result of type {type(result).__name__} cannot be held as a constant")
    return result


def evaluate_selection(selection: Selection) -> Evaluation:
    values: dict[torch.fx.Node, Any] = {n: s.tensor for n, s in selection.sources.items()}
    folded: list[torch.fx.Node] = []
    dropped: set[torch.fx.Node] = set()  # declined here, or reading such a node
    for node in selection.nodes:
        if dropped and any(p in dropped for p in node.all_input_nodes):
            dropped.add(node)
            continue
        value = evaluate(node, values)
        if isinstance(value, Declined):
            record_declined(FOLD, node.name, value.reason)
            dropped.add(node)
            continue
        values[node] = value
        folded.append(node)
    return Evaluation(values, tuple(folded))


def storage_key(tensor: torch.Tensor):
    return tensor.untyped_storage().data_ptr() if tensor.numel() else None


def fresh_constant(value: torch.Tensor, taken_storages: set) -> torch.Tensor:
    """A detached, contiguous tensor that shares storage with nothing in `taken_storages`
    (which it joins): a view of a source or of another result is copied."""
    shared = storage_key(value) in taken_storages
    needs_copy = shared or value._is_view() or not value.is_contiguous()
    value = value.detach()
    if needs_copy:
        value = value.clone(memory_format=torch.contiguous_format)
    key = storage_key(value)
    if key is not None:
        taken_storages.add(key)
    return value
