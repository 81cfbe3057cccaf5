"""The attention role's model runner: vLLM's, plus remote experts and the AFD session.

A mixin over vLLM's V1 runner (``CPUModelRunner`` on CPU, ``GPUModelRunner`` on CUDA), so the
two platforms share every line of AFD logic.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import torch
from vllm import forward_context as vllm_forward_context
from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context
from vllm.v1.worker.ubatch_utils import UBatchSlice

from afd_common.config import afd_config_from_vllm
from afd_common.vllm_glue.models import check_router
from afd_common.registry import resolve_connector
from afd_common.vllm_glue.model_thread import enter_model_thread
from afd_common.vllm_glue.patches import moe_parallel, weight_census
from afd_common.vllm_glue.model import expert_placement, layer_index, model_shape, weight_summary

from afd_attention.micro_batches import MicroBatchPipeline, split_on_requests
from afd_attention.patches import async_dp_enabled, async_dp_forward_context
from afd_attention.patches import moe_swap
from afd_attention.session import AttentionSession

logger = logging.getLogger("vllm.afd")


def warn_if_vllm_ends_the_ride_through_first(config, vllm_config) -> None:
    """vLLM's multiprocess executor (tensor or data parallelism) ends a step after
    ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``; a forward that waits for a returning FFN role longer
    than that fails there, whatever ``reconnect_timeout_s`` says."""
    import vllm.envs as envs

    bound, execute_s = config.extra.reconnect_timeout_s, envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
    if vllm_config.parallel_config.distributed_executor_backend == "mp" and bound >= execute_s:
        logger.warning("AFD: connector_extra_config.reconnect_timeout_s (%g s) is not below "
                       "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (%d s): vLLM's multiprocess "
                       "executor ends a forward that waits that long for a returning FFN role; "
                       "raise VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS too", bound, execute_s)


class AFDAttentionRunnerMixin:
    afd_session: AttentionSession | None = None
    _afd_patches = None
    _afd_pipeline: MicroBatchPipeline | None = None
    _afd_may_split = False
    _afd_split = None

    def load_model(self, *args, **kwargs):
        held: dict = {}
        with moe_swap.build().applied(), moe_parallel.build().applied(), \
                weight_census.build(held).applied():
            super().load_model(*args, **kwargs)
        logger.info("AFD weights: %s", json.dumps({
            "role": "attention", "by_category": held or weight_summary(self.model)}))
        self._afd_connect()

    def _afd_connect(self) -> None:
        from afd_attention.remote_moe import AFDAttentionMoERunner

        config = afd_config_from_vllm(self.vllm_config)
        runners = {layer_index(m.layer_name): m for m in self.model.modules()
                   if isinstance(m, AFDAttentionMoERunner)}
        shape = model_shape(self.vllm_config, runners,
                            expert_placement(self.vllm_config, config.num_ffn_ranks))
        check_router(self.vllm_config, runners, config.compute_gate_on_attention)
        # The DP index survives async DP, where each engine is reconfigured as DP rank 0 of 1.
        rank = self.vllm_config.parallel_config.data_parallel_index
        connector = resolve_connector(config.connector, "attention")(config, rank, shape,
                                                                     self.device)
        logger.info("AFD attention rank %d: %s connecting to the FFN role at %s:%d (%d MoE "
                    "layers, gate on %s); vLLM starts up meanwhile", rank, config.connector,
                    config.host, config.port,
                    len(shape.moe_layers),
                    "attention" if config.compute_gate_on_attention else "FFN")
        warn_if_vllm_ends_the_ride_through_first(config, self.vllm_config)
        if async_dp_enabled(config):
            self._afd_patches = async_dp_forward_context.build()
            self._afd_patches.install()
        vllm_config, device = self.vllm_config, self.device

        def new_connector(cfg):  # each later FFN world's (the session rides through a loss)
            return resolve_connector(cfg.connector, "attention")(cfg, rank, shape, device)

        session = self.afd_session = AttentionSession(
            config, connector, rank, new_connector,
            thread_setup=lambda: enter_model_thread(vllm_config, device))
        session.activate()
        if config.extra.num_micro_batches > 1:
            self._afd_pipeline = MicroBatchPipeline(
                config.extra.num_micro_batches,
                thread_setup=lambda: enter_model_thread(vllm_config, device))
            self._afd_splits_seen: set[int] = set()
        # vLLM's start-up goes on meanwhile: it must not wait for a role that may take longer
        # to load than vLLM waits for its engine (afd_attention.session).
        session.start_connecting()

    def afd_startup_done(self) -> None:
        if self.afd_session is not None:
            self.afd_session.startup_done()

    # Micro-batching: execute_model marks the window in which a step may be split; the attention
    # metadata is then built per micro-batch (vLLM's own per-ubatch path), and the forward runs
    # each micro-batch with its own forward context (afd_attention.micro_batches).

    def initialize_metadata_builders(self, kv_cache_config, kernel_block_sizes) -> None:
        super().initialize_metadata_builders(kv_cache_config, kernel_block_sizes)
        if self._afd_pipeline is None:
            return
        # Builders keep per-batch buffers: one per micro-batch, as vLLM keeps one per ubatch.
        for gid in range(len(kv_cache_config.kv_cache_groups)):
            for group in self.attn_groups[gid]:
                group.create_metadata_builders(
                    self.vllm_config, self.device,
                    kernel_block_sizes[gid] if gid < len(kernel_block_sizes) else None,
                    num_metadata_builders=self.afd_session.num_stages)

    def execute_model(self, *args, **kwargs):
        self._afd_may_split = (self._afd_pipeline is not None and not self.is_pooling_model
                               and self.speculative_config is None
                               and not self.use_aux_hidden_state_outputs
                               and getattr(self, "lookback_token_ids", None) is None)
        try:
            return super().execute_model(*args, **kwargs)
        finally:
            self._afd_may_split = False
            self._afd_split = None

    def _build_attention_metadata(self, *args, **kwargs):
        if (self._afd_may_split and kwargs.get("ubatch_slices") is None
                and not kwargs.get("for_cudagraph_capture")):
            num_reqs = kwargs["num_reqs"]
            parts = split_on_requests(self.query_start_loc.np[:num_reqs + 1],
                                      self.afd_session.num_stages)
            if len(parts) > 1:
                self._afd_split = [UBatchSlice(r, t) for r, t in parts]
                kwargs["ubatch_slices"] = self._afd_split
                if len(parts) not in self._afd_splits_seen:
                    self._afd_splits_seen.add(len(parts))
                    logger.info("AFD attention: first step split into %d micro-batches (%s "
                                "tokens)", len(parts), [t.stop - t.start for _, t in parts])
        return super()._build_attention_metadata(*args, **kwargs)

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None,
                       inputs_embeds=None, **model_kwargs):
        session = self.afd_session
        split, self._afd_split = self._afd_split, None
        start = time.perf_counter()
        forward = super()._model_forward

        def run():
            if split is None:
                session.stage_started(0)
                return forward(input_ids, positions, intermediate_tensors, inputs_embeds,
                               **model_kwargs)
            return self._afd_split_forward(split, input_ids, positions, intermediate_tensors,
                                           inputs_embeds, model_kwargs)

        try:
            # Run again from its start if the FFN role is lost meanwhile and another comes back:
            # the inputs are unchanged and the KV cache is written to the same slots.
            return session.run_forward(run)
        finally:
            session.metrics.step(time.perf_counter() - start)

    def _dummy_run(self, *args, **kwargs):
        # An idle DP rank's dummy batch calls the model directly, not through _model_forward: it
        # is a step for the FFN role all the same, and its model call is run again the same way.
        # Only the model call: the rest of the dummy run agrees on the batch with the other DP
        # ranks (a collective), which must happen once, as on the ranks running real steps.
        session = self.afd_session
        if session is None:
            return super()._dummy_run(*args, **kwargs)
        model = self.model
        self.model = _RerunOnLoss(model, session)
        try:
            return super()._dummy_run(*args, **kwargs)
        finally:
            self.model = model

    def _afd_split_forward(self, split, input_ids, positions, intermediate_tensors,
                           inputs_embeds, model_kwargs):
        if intermediate_tensors is not None or model_kwargs:
            raise RuntimeError("AFD micro-batching got pipeline-parallel or extra model inputs "
                               f"({sorted(model_kwargs)}); use num_micro_batches 1")
        session = self.afd_session
        whole = get_forward_context()
        rows = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        cuts = [s.token_slice for s in split]
        cuts[-1] = slice(cuts[-1].start, rows)  # padding rows, if any, ride with the last
        contexts = [dataclasses.replace(
            whole, attn_metadata=whole.attn_metadata[i],
            slot_mapping={k: v[cut] for k, v in whole.slot_mapping.items()},
            is_padding=None if whole.is_padding is None else whole.is_padding[cut],
            # Graphs are captured for whole batches; a micro-batch runs eagerly (CUDA only).
            cudagraph_runtime_mode=CUDAGraphMode.NONE, batch_descriptor=None)
            for i, cut in enumerate(cuts)]
        forward = super()._model_forward

        def micro_batch(cut: slice) -> torch.Tensor:
            return forward(None if input_ids is None else input_ids[cut], positions[..., cut],
                           None, None if inputs_embeds is None else inputs_embeds[cut])

        def resume(i: int) -> None:
            vllm_forward_context._forward_context = contexts[i]

        try:
            outs = session.run_micro_batches(self._afd_pipeline, cuts, micro_batch, resume)
        finally:
            vllm_forward_context._forward_context = whole
        return torch.cat(outs)

    def afd_close(self) -> None:
        if self._afd_patches is not None:
            self._afd_patches.uninstall()
            self._afd_patches = None
        if self.afd_session is not None:
            self.afd_session.close()
            self.afd_session = None


class _RerunOnLoss:
    """The model, as a dummy run sees it: a call runs again from its start when the FFN role is
    lost during it (``AttentionSession.run_forward``); anything else is the model's."""

    def __init__(self, model, session: AttentionSession):
        self._model, self._session = model, session

    def __call__(self, *args, **kwargs):
        return self._session.run_forward(lambda: self._model(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self._model, name)


class AFDAttentionWorkerMixin:
    """The attention role's additions to vLLM's worker (CPU and CUDA alike)."""

    def compile_or_warm_up_model(self, *args, **kwargs):
        # The engine core's last start-up call: every forward after it is served by the FFN role.
        out = super().compile_or_warm_up_model(*args, **kwargs)
        self.model_runner.afd_startup_done()
        return out

    def shutdown(self):
        runner = getattr(self, "model_runner", None)
        if isinstance(runner, AFDAttentionRunnerMixin):
            runner.afd_close()
        super().shutdown()
