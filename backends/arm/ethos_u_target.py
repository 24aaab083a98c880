# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Backend passes learn which Ethos-U NPU a lowering is for (`_passes/lowering_target.py`).

Some folds pay on one NPU only. `EthosUBackend.preprocess` is the one place the
Ethos-U compile spec is still known: the backend pipeline below it gets a
TOSA-only spec (`TOSABackend.filter_tosa_compile_specs`). So while etfold's
folds are registered, that preprocess runs inside `lowering_for(its spec)`; a
direct `ArmPassManager(EthosUCompileSpec(...))` run is covered by wrapping
`transform_to_backend_pipeline`, and `EthosUQuantizer`'s annotation run (before
calibration) by wrapping `transform_for_annotation_pipeline`.
"""

from __future__ import annotations

from collections.abc import Callable


def target_aware(original: Callable) -> Callable:
    """An ArmPassManager pipeline method run inside `lowering_for` its Ethos-U compile spec."""
    from etfold.backends.arm._passes.lowering_target import is_ethos_u_spec, lowering_for

    def pipeline(self, *args, **kwargs):
        if not is_ethos_u_spec(self.compile_spec):
            return original(self, *args, **kwargs)
        with lowering_for(self.compile_spec):
            return original(self, *args, **kwargs)

    pipeline.__name__ = pipeline.__qualname__ = original.__name__
    pipeline.__etfold_wrapped__ = original  # type: ignore[attr-defined]
    return pipeline


def preprocess_for_its_target(original: staticmethod) -> staticmethod:
    """EthosUBackend.preprocess, run inside `lowering_for(its EthosUCompileSpec)`."""
    from etfold.backends.arm._passes.lowering_target import lowering_for

    def preprocess(edge_program, compile_specs):
        from executorch.backends.arm.ethosu import EthosUCompileSpec

        with lowering_for(EthosUCompileSpec._from_list(compile_specs)):
            return original.__func__(edge_program, compile_specs)

    preprocess.__etfold_wrapped__ = original  # type: ignore[attr-defined]
    return staticmethod(preprocess)
