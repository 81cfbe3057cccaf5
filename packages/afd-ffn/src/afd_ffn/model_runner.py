"""The FFN role's model runner: builds only the MoE blocks' weights and serves them.

A mixin over vLLM's V1 runner (``CPUModelRunner`` / ``GPUModelRunner``), so CPU and CUDA share
every line of AFD logic.
"""

from __future__ import annotations

import json
import logging

from afd_common import metrics
from afd_common.config import afd_config_from_vllm
from afd_common.vllm_glue.models import check_router
from afd_common.vllm_glue.patches import moe_parallel, weight_census
from afd_common.vllm_glue.model import expert_placement, layer_index, model_shape, weight_summary

from afd_ffn.experts import LayerExperts
from afd_ffn.patches import prune
from afd_ffn.service import FFNService

logger = logging.getLogger("vllm.afd")


class AFDFFNRunnerMixin:
    afd_service: FFNService | None = None

    def load_model(self, *args, **kwargs):
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        config = afd_config_from_vllm(self.vllm_config)
        rank = self.vllm_config.parallel_config.data_parallel_index
        placement = expert_placement(self.vllm_config, config.num_ffn_ranks)
        held: dict = {}
        with prune.build().applied(), moe_parallel.build(placement, rank).applied(), \
                weight_census.build(held).applied():
            super().load_model(*args, **kwargs)
        logger.info("AFD weights: %s", json.dumps({
            "role": "ffn", "ffn_rank": rank, "by_category": held or weight_summary(self.model)}))
        logger.info("AFD FFN rank %d: routed experts %s; this rank holds %s", rank,
                    placement.describe(), _ranges(placement.local_experts(rank)))
        runners = {layer_index(m.layer_name): m for m in self.model.modules()
                   if isinstance(m, MoERunner)}
        shape = model_shape(self.vllm_config, runners, placement)
        check_router(self.vllm_config, runners, config.compute_gate_on_attention)
        experts = LayerExperts(self.vllm_config, runners, placement, rank)
        recorder = metrics.recorder("ffn", config.connector)
        experts.on_routed = lambda layer, ids: recorder.expert_pairs(layer, ids,
                                                                     shape.num_experts)
        self.afd_service = FFNService(config, rank, shape, experts, self.device,
                                      self.vllm_config)
        self.afd_service.start()


def _ranges(ids: tuple[int, ...]) -> str:
    return ", ".join(str(i) for i in ids) if len(ids) < 16 else f"{len(ids)} experts"
