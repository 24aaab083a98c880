"""etfold's XnnpackPartitioner: upstream's, plus the folds that let XNNPACK take more.

Drop-in: the same constructor arguments as upstream's, plus
- `fold_weights`: fold parameter-only GEMM weight subgraphs before decomposition
  (the weight-fold issue);
- `delegate_dtype_converts`: accept fp32 <-> fp16/bf16 converts of activations
  (the dtype-convert issue).
"""

from __future__ import annotations

from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)


class XnnpackPartitioner(UpstreamXnnpackPartitioner):
    def __init__(
        self,
        configs=None,
        config_precisions=None,
        per_op_mode: bool = False,
        verbose: bool = False,
        *,
        fold_weights: bool = True,
        delegate_dtype_converts: bool = True,
        **kwargs,
    ):
        super().__init__(configs, config_precisions, per_op_mode, verbose, **kwargs)
        self.fold_weights = fold_weights
        self.delegate_dtype_converts = delegate_dtype_converts
