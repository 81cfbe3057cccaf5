"""The attention role's model runner: vLLM's, plus remote experts and the AFD session.

A mixin over vLLM's V1 runner (``CPUModelRunner`` on CPU, ``GPUModelRunner`` on CUDA), so the
two platforms share every line of AFD logic.
"""

from __future__ import annotations

import json
import logging

from afd_common.config import afd_config_from_vllm
from afd_common.errors import AFDConfigError
from afd_common import lifecycle
from afd_common.registry import resolve_connector
from afd_common.vllm_model import layer_index, model_shape, weight_summary

from afd_attention.patches import async_dp_enabled, async_dp_forward_context
from afd_attention.patches import remote_moe as remote_moe_patch
from afd_attention.session import AttentionSession

logger = logging.getLogger("vllm.afd")


class AFDAttentionRunnerMixin:
    afd_session: AttentionSession | None = None
    _afd_patches = None

    def load_model(self, *args, **kwargs):
        with remote_moe_patch.build().applied():
            super().load_model(*args, **kwargs)
        logger.info("AFD weights: %s", json.dumps({"role": "attention",
                                                   "by_category": weight_summary(self.model)}))
        self._afd_connect()

    def _afd_connect(self) -> None:
        from afd_attention.remote_moe import AFDAttentionMoERunner

        config = afd_config_from_vllm(self.vllm_config)
        if config.extra.num_micro_batches != 1:
            raise AFDConfigError("connector_extra_config.num_micro_batches",
                                 config.extra.num_micro_batches,
                                 "micro-batching inside vLLM steps is not available in this "
                                 "version; use 1")
        runners = {layer_index(m.layer_name): m for m in self.model.modules()
                   if isinstance(m, AFDAttentionMoERunner)}
        shape = model_shape(self.vllm_config, runners)
        # The DP index survives async DP, where each engine is reconfigured as DP rank 0 of 1.
        rank = self.vllm_config.parallel_config.data_parallel_index
        connector = resolve_connector(config.connector, "attention")(config, rank, shape,
                                                                     self.device)
        logger.info("AFD attention rank %d: %s connecting to the FFN role at %s:%d (%d MoE "
                    "layers, gate on %s)", rank, config.connector, config.host, config.port,
                    len(shape.moe_layers),
                    "attention" if config.compute_gate_on_attention else "FFN")
        if async_dp_enabled(config):
            self._afd_patches = async_dp_forward_context.build()
            self._afd_patches.install()
        connector.init()
        session = self.afd_session = AttentionSession(config, connector)

        def on_lost(reason: str) -> None:
            reason = f"attention rank {rank}: the FFN role is gone ({reason})"
            lifecycle.mark_failed(reason)
            if session.peer_lost(reason):
                lifecycle.exit_worker()

        connector.watch_peers(on_lost)
        session.activate()
        logger.info("AFD attention rank %d: connected", rank)

    def afd_close(self) -> None:
        if self._afd_patches is not None:
            self._afd_patches.uninstall()
            self._afd_patches = None
        if self.afd_session is not None:
            self.afd_session.close()
            self.afd_session = None
