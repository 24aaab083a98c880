# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Which Arm target a backend pipeline is lowering for.

A backend pass sees the graph and the TOSA specification, not the compile spec
that says whether the TOSA goes on to Vela: `EthosUBackend.preprocess` hands
the pass pipeline a TOSA-only spec. While etfold's folds are registered,
`EthosUBackend.preprocess` (and a pipeline built directly from an
`EthosUCompileSpec`) runs inside `lowering_for(compile_spec)`; outside it the
target is unknown (None).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_compile_spec: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "etfold_arm_compile_spec", default=None
)


@contextlib.contextmanager
def lowering_for(compile_spec: object) -> Iterator[None]:
    token = _compile_spec.set(compile_spec)
    try:
        yield
    finally:
        _compile_spec.reset(token)


def is_ethos_u_spec(compile_spec: object) -> bool:
    from executorch.backends.arm.ethosu import EthosUCompileSpec

    return isinstance(compile_spec, EthosUCompileSpec)


def ethos_u_target() -> str | None:
    """The Ethos-U accelerator being lowered for ("ethos-u55-128", …), or None."""
    spec = _compile_spec.get()
    return spec.target if is_ethos_u_spec(spec) else None
