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
from torch.export import ExportedProgram

from etfold.backends.xnnpack.partition.weight_fold import fold_gemm_weights, seed_slots


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

    # ---- weight fold (issue 4): parameter-only GEMM weights become static before partitioning
    def transform_for_pre_decomposition(self, exported_program: ExportedProgram) -> ExportedProgram:
        exported_program = super().transform_for_pre_decomposition(exported_program)
        if not self.fold_weights:
            return exported_program
        slots = seed_slots(self.target_partitioner_configs.values())
        return fold_gemm_weights(exported_program, slots)

    # ---- end weight fold
