# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Provenance chains shared, not deep-copied, each time a pass re-creates a node.

Every node an FX interpreter re-creates records where it came from: a
`torch.fx.traceback.NodeSource` holding a deep copy of the source node's
`meta["from_node"]`, itself the chain of every earlier pass. The chain grows by
one link per pass, so a lowering of ~150 passes deep-copies ever longer chains:
a quarter to a third of lowering a small decoder. Nothing mutates a NodeSource
after it is built (torch appends only to a node's own `meta["from_node"]` list),
so inside `shared_provenance_chains()` the new NodeSource takes a fresh list of
the same NodeSource objects. Every chain reads, compares and serializes as
torch's deep copy would; every other value is deep-copied by `copy.deepcopy`.
"""

from __future__ import annotations

import contextlib
import copy
import types

from torch.fx import traceback as fx_traceback

from etfold.exir.program.reentrant_patch import PatchUnavailable, ReentrantPatch, Replacement


def _copy_sharing_provenance(torch_copy: types.ModuleType) -> types.ModuleType:
    """`copy` as the traceback module sees it, except that inside the scope a NodeSource
    chain is copied shallowly."""
    shim = types.ModuleType(torch_copy.__name__)
    shim.__dict__.update(torch_copy.__dict__)

    def deepcopy(value, memo=None):
        if (
            PATCH.active()
            and isinstance(value, list)
            and all(isinstance(link, fx_traceback.NodeSource) for link in value)
        ):
            return list(value)
        return torch_copy.deepcopy(value, memo)

    shim.deepcopy = deepcopy
    return shim


def _replacements() -> list[Replacement]:
    if getattr(fx_traceback, "copy", None) is not copy:
        raise PatchUnavailable("torch.fx.traceback no longer deep-copies through `copy`")
    if not isinstance(getattr(fx_traceback, "NodeSource", None), type):
        raise PatchUnavailable("torch.fx.traceback.NodeSource is gone")
    return [Replacement(fx_traceback, "copy", _copy_sharing_provenance, gated=False)]


PATCH = ReentrantPatch("shared_provenance", _replacements)


def shared_provenance_chains() -> contextlib.AbstractContextManager[None]:
    """While entered, NodeSource chains are shared, not deep-copied, in this context."""
    return PATCH.scope()
