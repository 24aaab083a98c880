# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Inside an etfold-marked XNNPACK delegate, turn float dtype copies into converts.

    _to_dim_order_copy(x, dtype=d) | _to_copy(x, dtype=d)      (layout of x kept)
      -> prims.convert_element_type(x, d)                      {dtype(x), d} = {fp32, fp16|bf16}

Runs at the front of XNNPACK preprocess, before upstream's pass list. Upstream's
passes treat every `_to_copy` as a layout change (tag by `memory_format`, drop
when "redundant"); a convert is element-wise, so after this rewrite they give it
their generic treatment and its layout follows its input. The node keeps its
name and metadata, so the program signature stays valid.

A dtype-changing copy that does not match must not reach upstream's copy
visitor (it would be serialized as a transpose), so this pass raises on it.
"""

from __future__ import annotations

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from etfold.backends.xnnpack._passes.dtype_convert_match import (
    CONVERT_TARGET,
    FOLD,
    DtypeConvert,
    changes_dtype,
    has_tensor_meta,
    is_copy,
    match_dtype_convert,
)
from etfold.decisions import Declined, record_applied


class UnsupportedDtypeCopyError(RuntimeError):
    pass


def rewrite_as_convert(match: DtypeConvert) -> None:
    node = match.node
    node.target = CONVERT_TARGET
    node.args = (node.args[0], match.target)
    node.kwargs = {}


class RewriteDtypeCopiesAsConvertsPass(PassBase):
    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        matches: list[DtypeConvert] = []
        for node in graph_module.graph.nodes:
            if not (is_copy(node) and has_tensor_meta(node) and changes_dtype(node)):
                continue
            match = match_dtype_convert(node)
            if isinstance(match, Declined):
                raise UnsupportedDtypeCopyError(
                    f"{node.name} reached the XNNPACK delegate but cannot run as a convert: "
                    f"{match.reason}"
                )
            matches.append(match)
        for match in matches:
            rewrite_as_convert(match)
            record_applied(FOLD, match.node.name, match.describe())
        if matches:
            graph_module.recompile()
        return PassResult(graph_module, bool(matches))
