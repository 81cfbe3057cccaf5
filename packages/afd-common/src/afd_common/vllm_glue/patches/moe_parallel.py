"""While a role builds its model: the MoE layers' parallelism is AFD's, not vLLM's DP/TP fold.

vLLM builds an MoE layer under ``--data-parallel-size N`` as tensor-parallel over the N ranks (or,
with ``--enable-expert-parallel``, expert-parallel with an all-to-all between them). In AFD the
DP ranks of a role do not share MoE work with each other:

* the attention role holds no routed experts, so its MoE layers need no parallelism at all;
* a replicated FFN rank holds every expert in full, as if DP were 1;
* a sharded FFN rank holds its EP share (EP rank = its FFN rank, EP size = the FFN ranks) and
  computes it locally: the attention side, not an all-to-all, brings it its rows.

Installed only around model construction (``FusedMoEParallelConfig.make`` is consulted there).
"""

from __future__ import annotations

from afd_common.vllm_glue.patching import PatchSet
from afd_common.placement import ExpertPlacement


def build(placement: ExpertPlacement | None = None, ffn_rank: int = 0) -> PatchSet:
    """``placement`` None: the attention role (no parallelism); else the FFN rank's placement."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    sharded = placement is not None and placement.sharded

    def make(tp_size_, pcp_size_, dp_size_, sp_size_, vllm_parallel_config):
        config = FusedMoEParallelConfig.make_no_parallel()
        config.all2all_backend = vllm_parallel_config.all2all_backend
        config.sp_size = sp_size_
        if sharded:
            config.use_ep = True
            config.ep_size, config.ep_rank = placement.num_ffn_ranks, ffn_rank
        return config

    return PatchSet("moe_parallel").setattr(FusedMoEParallelConfig, "make", staticmethod(make))
