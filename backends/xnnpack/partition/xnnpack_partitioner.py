"""etfold's XnnpackPartitioner: upstream's, plus the folds that let XNNPACK take more.

Drop-in: the same constructor arguments as upstream's, plus
- `fold_weights`: fold parameter-only GEMM weight subgraphs before decomposition
  (the weight-fold issue);
- `delegate_dtype_converts`: accept fp32 <-> fp16/bf16 converts of activations
  (the dtype-convert issue).
"""

from __future__ import annotations

from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from executorch.exir.backend.partitioner import DelegationSpec, PartitionResult
from torch.export import ExportedProgram

from etfold.backends.xnnpack._passes.dtype_convert_match import DtypeConvert, match_dtype_convert
from etfold.backends.xnnpack._passes.widen_fp16_gelu_pass import widen_fp16_gelu
from etfold.backends.xnnpack.install import DTYPE_CONVERTS_SPEC, install
from etfold.backends.xnnpack.partition.bf16_delegation import bf16_scope
from etfold.backends.xnnpack.partition.config.convert_config import with_dtype_convert_configs
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
        if delegate_dtype_converts:
            configs = self._dtype_convert_configs(configs)
        super().__init__(configs, config_precisions, per_op_mode, verbose, **kwargs)
        self.fold_weights = fold_weights
        self.delegate_dtype_converts = delegate_dtype_converts
        # upstream's kwargs carry enable_bf16; absent means "not set" (bf16 follows the program)
        self._user_enable_bf16 = kwargs.get("enable_bf16")

    # ---- weight fold (issue 4): parameter-only GEMM weights become static before partitioning
    def transform_for_pre_decomposition(self, exported_program: ExportedProgram) -> ExportedProgram:
        exported_program = super().transform_for_pre_decomposition(exported_program)
        if self.delegate_dtype_converts:
            exported_program = widen_fp16_gelu(exported_program)
        if not self.fold_weights:
            return exported_program
        slots = seed_slots(self.target_partitioner_configs.values())
        return fold_gemm_weights(exported_program, slots)

    # ---- end weight fold

    # ---- dtype converts (issue 5): fp32 <-> fp16/bf16 converts of activations join delegates
    @staticmethod
    def _dtype_convert_configs(configs):
        return with_dtype_convert_configs(list(configs or ALL_PARTITIONER_CONFIGS))

    def _mark_convert_partitions(self, result: PartitionResult) -> PartitionResult:
        """The compile spec (it tells etfold's preprocess wrapper to rewrite converts) goes
        only on partitions holding a delegated convert; the others keep upstream's spec."""
        spec = self.delegation_spec
        marked = DelegationSpec(spec.backend_id, [*spec.compile_specs, DTYPE_CONVERTS_SPEC])
        tags = {
            node.meta.get("delegation_tag")
            for node in result.tagged_exported_program.graph.nodes
            if isinstance(match_dtype_convert(node), DtypeConvert)
        }
        partition_tags = {
            tag: marked if tag in tags else tag_spec
            for tag, tag_spec in result.partition_tags.items()
        }
        return PartitionResult(result.tagged_exported_program, partition_tags)

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        if self.delegate_dtype_converts:
            install()  # idempotent; marked delegates must never reach an unwrapped preprocess
        configs = self.target_partitioner_configs.values()
        with bf16_scope(exported_program, self._user_enable_bf16, configs):
            result = super().partition(exported_program)
        if self.delegate_dtype_converts:
            result = self._mark_convert_partitions(result)
        return result

    # ---- end dtype converts
