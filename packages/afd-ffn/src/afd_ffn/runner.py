"""The FFN role's model runner: builds only the MoE blocks' weights and serves them.

A mixin over vLLM's V1 runner (``CPUModelRunner`` / ``GPUModelRunner``), so CPU and CUDA share
every line of AFD logic.
"""

from __future__ import annotations

import json
import logging

from afd_common.config import afd_config_from_vllm
from afd_common.vllm_model import layer_index, model_shape, weight_summary

from afd_ffn.experts import LayerExperts
from afd_ffn.patches import prune
from afd_ffn.service import FFNService

logger = logging.getLogger("vllm.afd")


class AFDFFNRunnerMixin:
    afd_service: FFNService | None = None

    def load_model(self, *args, **kwargs):
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        with prune.build().applied():
            super().load_model(*args, **kwargs)
        logger.info("AFD weights: %s", json.dumps({"role": "ffn",
                                                   "by_category": weight_summary(self.model)}))
        runners = {layer_index(m.layer_name): m for m in self.model.modules()
                   if isinstance(m, MoERunner)}
        config = afd_config_from_vllm(self.vllm_config)
        shape = model_shape(self.vllm_config, runners)
        rank = self.vllm_config.parallel_config.data_parallel_index
        self.afd_service = FFNService(config, rank, shape,
                                      LayerExperts(self.vllm_config, runners), self.device)
        self.afd_service.start()
