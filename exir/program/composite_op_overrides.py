# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Torch's composite-op overrides for one decomposition, written op by op, not key by key.

For each trace it runs, `run_decompositions` overrides the kernels of every
functional CompositeImplicitAutograd op (~550): under each of ~20 dispatch keys
it registers a Python kernel through `OperatorBase.py_impl`, whose checks and
dispatch-cache clearing run once per key. That is ~12,000 registrations, about
80 ms a call and three calls per lowering: a fifth of lowering a small model.
Inside `one_override_write_per_composite_op()` each op gets the same kernels
under the same keys, in the same order, and the same fake-tensor rule, written
into its kernel table at once with its dispatch cache cleared once (an op
without Python kernels from dicts that keep the keys' hashes: hashing a
`DispatchKey` is a call into C++); on exit every op is restored exactly as
torch restores it. Where torch's internals are not the ones this was written
against, the scope changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._ops import OperatorBase, OpOverload

from etfold.exir.program.reentrant_patch import ReentrantPatch

_DEFINED_IN = "torch.export.exported_program"
_OVERRIDE = "_override_composite_implicit_decomp"
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd


@dataclass(frozen=True)
class _TorchInternals:
    autograd_keys: tuple
    backend_keys: tuple
    original_composite_kernel: Callable
    refuse_autograd: Callable
    has_fake_rule: Callable
    register_fake_rule: Callable
    deregister_fake_rule: Callable
    keys_added_to_no_kernels: tuple[dict, ...] | None


def _torch_internals() -> _TorchInternals | None:
    try:
        from torch._export.utils import _get_decomp_for_cia
        from torch._higher_order_ops.utils import autograd_not_implemented
        from torch._subclasses import fake_impls

        defining = importlib.import_module(_DEFINED_IN)
        autograd_keys = tuple(defining._AUTOGRAD_ALIAS_BACKEND_KEYS_TO_OVERRIDE)
        backend_keys = tuple(defining._BACKEND_KEYS_TO_OVERRIDE)
        return _TorchInternals(
            autograd_keys=autograd_keys,
            backend_keys=backend_keys,
            original_composite_kernel=_get_decomp_for_cia,
            refuse_autograd=autograd_not_implemented,
            has_fake_rule=fake_impls._is_op_registered_to_fake_rule,
            register_fake_rule=fake_impls.register_op_impl,
            deregister_fake_rule=fake_impls._deregister_op_impl,
            keys_added_to_no_kernels=_keys_added_to_no_kernels(autograd_keys, backend_keys),
        )
    except (ImportError, AttributeError):
        return None


def _fake_rule_running(original: Callable) -> Callable:
    """Under fake tensors, run the op's own composite kernel before any override is consulted."""

    def fake_rule(fake_mode, op, *args, **kwargs):
        with fake_mode:
            return original(*args, **kwargs)

    return fake_rule


def _registers_by_dict_write(op) -> bool:
    """An op whose `py_impl` is OperatorBase's: registering a kernel writes its kernel table."""
    return isinstance(op, OpOverload) and type(op).py_impl is OperatorBase.py_impl


def _keys_added_to_no_kernels(autograd_keys: tuple, backend_keys: tuple) -> tuple | None:
    """The keys torch's override gives an op without Python kernels, in the order it adds them
    (None where an autograd key is the composite one: then torch's order is followed key by key).

    As dicts: a dict keeps each key's hash, and hashing a `DispatchKey` is a call into
    C++ (~0.5 us, 20 keys an op), so filling a kernel table from them rehashes nothing.
    """
    if _COMPOSITE in autograd_keys:
        return None
    autograd = dict.fromkeys(autograd_keys)
    backend = [key for key in backend_keys if key not in autograd and key != _COMPOSITE]
    return autograd, {_COMPOSITE: None}, dict.fromkeys(backend)


def _override(op: OpOverload, decomposition: Callable, torch_: _TorchInternals) -> None:
    """One op's kernels as torch's override leaves them, written in the order torch writes them."""
    if op.py_kernels or torch_.keys_added_to_no_kernels is None:
        _override_key_by_key(op, decomposition, torch_)
    else:
        _override_no_kernels(op, decomposition, torch_)
    op._dispatch_cache.clear()


def _override_key_by_key(op: OpOverload, decomposition: Callable, torch_: _TorchInternals) -> None:
    kernels = op.py_kernels
    refuse = torch_.refuse_autograd(op, deferred_error=True)
    for key in torch_.autograd_keys:
        kernels.setdefault(key, refuse)
    original = torch_.original_composite_kernel(op)
    kernels.pop(_COMPOSITE, None)
    kernels[_COMPOSITE] = decomposition
    _fake_rule_unless_registered(op, original, torch_)
    for key in torch_.backend_keys:
        kernels.setdefault(key, original)


def _override_no_kernels(op: OpOverload, decomposition: Callable, torch_: _TorchInternals) -> None:
    """`_override_key_by_key` for an op without Python kernels: the table gets the same keys
    in the same order; its composite kernel is asked for first, as the autograd keys torch
    adds before asking cannot hold it."""
    autograd, composite, backend = torch_.keys_added_to_no_kernels
    original = torch_.original_composite_kernel(op)
    kernels = op.py_kernels
    kernels.update(dict.fromkeys(autograd, torch_.refuse_autograd(op, deferred_error=True)))
    kernels.update(dict.fromkeys(composite, decomposition))
    _fake_rule_unless_registered(op, original, torch_)
    kernels.update(dict.fromkeys(backend, original))


def _fake_rule_unless_registered(
    op: OpOverload, original: Callable, torch_: _TorchInternals
) -> None:
    if not torch_.has_fake_rule(op):
        torch_.register_fake_rule(op)(_fake_rule_running(original))


def _restore(op: OpOverload, saved: dict, torch_: _TorchInternals) -> None:
    op.py_kernels.clear()
    op.py_kernels.update(saved)
    op._dispatch_cache.clear()
    torch_.deregister_fake_rule(op)


def _override_by_op(torchs_override: Callable, torch_: _TorchInternals) -> Callable:
    @functools.wraps(torchs_override)
    @contextlib.contextmanager
    def override(cia_ops_to_callable):
        if not all(_registers_by_dict_write(op) for op in cia_ops_to_callable):
            with torchs_override(cia_ops_to_callable):
                yield
            return
        saved: dict[OpOverload, dict] = {}
        try:
            for op, decomposition in cia_ops_to_callable.items():
                saved[op] = op.py_kernels.copy()
                _override(op, decomposition, torch_)
            yield
        finally:
            for op, kernels in saved.items():
                _restore(op, kernels, torch_)

    return override


_saved: list[Callable] = []


def _install() -> None:
    torch_ = _torch_internals()
    defining = importlib.import_module(_DEFINED_IN)
    torchs_override = getattr(defining, _OVERRIDE, None)
    if torch_ is None or not callable(torchs_override):
        return
    _saved.append(torchs_override)
    setattr(defining, _OVERRIDE, _override_by_op(torchs_override, torch_))


def _uninstall() -> None:
    if _saved:
        setattr(importlib.import_module(_DEFINED_IN), _OVERRIDE, _saved.pop())


_PATCH = ReentrantPatch(_install, _uninstall)


def torchs_override() -> Callable:
    """Torch's own override, also while the scope is entered (what the scope is compared against)."""
    return _saved[0] if _saved else getattr(importlib.import_module(_DEFINED_IN), _OVERRIDE)


def one_override_write_per_composite_op() -> contextlib.AbstractContextManager[None]:
    """While entered (re-entrantly, from any thread), each override writes an op's kernels at once."""
    return _PATCH.scope()
