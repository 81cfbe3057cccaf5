"""Running one work item through one layer's routed experts, with vLLM's own MoE modules.

The same arithmetic as vLLM's fused MoE call up to the routed output (gate -> top-k ->
weighted experts); ``routed_scaling_factor`` and the shared experts are applied on the attention
role.

A work item of an async connector routes each row to one expert with weight 1 (``topk_ids``
[rows, 1]); the attention side weights and sums the rows.
"""

from __future__ import annotations

import torch

from afd_common.forward_metadata import ffn_forward_context
from afd_common.metadata import WorkItem


class LayerExperts:
    def __init__(self, vllm_config, runners: dict[int, object]):
        self.vllm_config = vllm_config
        self.runners = runners

    @torch.inference_mode()
    def __call__(self, item: WorkItem, plan=None) -> torch.Tensor:
        runner = self.runners[item.layer_idx]
        x = item.hidden_states
        with ffn_forward_context(self.vllm_config, item):
            if item.topk_ids is None:
                logits, _ = runner.gate(x)
                topk_weights, topk_ids = runner.router.select_experts(
                    hidden_states=x, router_logits=logits,
                    topk_indices_dtype=getattr(runner.routed_experts.quant_method,
                                               "topk_indices_dtype", None))
            else:
                topk_weights, topk_ids = item.topk_weights, item.topk_ids
            runner.routed_experts._ensure_moe_quant_config_init()
            out = runner.routed_experts.forward_modular(x, topk_weights, topk_ids)
        return out.contiguous()
