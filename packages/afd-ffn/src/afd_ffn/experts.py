"""Running one work item through one layer's routed experts, with vLLM's own MoE modules.

The same arithmetic as vLLM's fused MoE call up to the routed output (gate -> top-k ->
weighted experts); ``routed_scaling_factor`` and the shared experts are applied on the attention
role.

A work item of an async connector routes each row to one expert with weight 1 (``topk_ids``
[rows, 1]); the attention side weights and sums the rows.

With sharded experts (``afd_common.placement``) this rank holds only its share, loaded by vLLM's
weight loader at vLLM's local indices. The rows that reach it carry their global top-k; only the
(row, expert) pairs of local experts are computed -- each as a top-1 problem on the local
weights, so no compute is spent on another rank's experts -- and summed per row. vLLM's own
``expert_map`` is dropped after loading: not every kernel honours it (the CPU kernels ignore it),
and the ids handed to the kernel are already local.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from afd_common.metadata import WorkItem
from afd_common.placement import ExpertPlacement


class LayerExperts:
    def __init__(self, vllm_config, runners: dict[int, object], placement: ExpertPlacement,
                 ffn_rank: int):
        self.vllm_config = vllm_config
        self.runners = runners
        self.placement = placement
        self.on_routed = None  # (layer, global topk_ids) -> None: expert-load metrics
        self._local_of: torch.Tensor | None = None
        if placement.sharded:
            ours = placement.expert_map(ffn_rank)
            for layer, runner in runners.items():
                loaded = runner.routed_experts.expert_map
                if loaded is None or not torch.equal(loaded.cpu().to(torch.int32), ours):
                    raise RuntimeError(
                        f"FFN rank {ffn_rank}, layer {layer}: vLLM placed the routed experts as "
                        f"{None if loaded is None else loaded.tolist()}, afd expects "
                        f"{ours.tolist()} ({placement.describe()}); refusing to serve a "
                        "placement the attention role would route differently")
                runner.routed_experts._expert_map = None
            self._local_of = ours.to(torch.int64)

    @torch.inference_mode()
    def __call__(self, item: WorkItem) -> torch.Tensor:
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
            experts = runner.routed_experts
            experts._ensure_moe_quant_config_init()
            if self._local_of is None:
                if self.on_routed is not None:
                    self.on_routed(item.layer_idx, topk_ids)
                out = experts.forward_modular(x, topk_weights, topk_ids)
            else:
                out = self._local_share(item.layer_idx, experts, x, topk_weights, topk_ids)
        return out.contiguous()

    def _local_share(self, layer, experts, x, topk_weights, topk_ids) -> torch.Tensor:
        """Sum over this rank's experts only of weight x expert(row)."""
        local = self._local_of.to(topk_ids.device)[topk_ids.long()]
        mine = local >= 0
        if self.on_routed is not None:  # count only the pairs computed here
            self.on_routed(layer, torch.where(mine, topk_ids.long(), -1))
        rows, slots = mine.nonzero(as_tuple=True)
        out = torch.zeros_like(x)
        if rows.numel():
            pairs = experts.forward_modular(
                x.index_select(0, rows), topk_weights[rows, slots].unsqueeze(1).contiguous(),
                local[rows, slots].to(topk_ids.dtype).unsqueeze(1).contiguous())
            out.index_add_(0, rows, pairs)
        return out


@contextmanager
def ffn_forward_context(vllm_config, item: WorkItem):
    """The forward context of one work item: vLLM's MoE code reads one, and an FFN rank runs
    its experts outside any vLLM step. No DP metadata: an FFN rank computes its rows alone, and
    building it would all-reduce with FFN ranks busy with other items."""
    from vllm.forward_context import get_forward_context, set_forward_context

    n = item.num_tokens
    dp = vllm_config.parallel_config.data_parallel_size
    # Given counts keep vLLM from all-reducing them across DP ranks; the metadata is dropped.
    across = torch.full((dp,), n, dtype=torch.int32) if dp > 1 else None
    with set_forward_context(None, vllm_config, num_tokens=n, num_tokens_across_dp=across):
        ctx = get_forward_context()
        ctx.dp_metadata = None
        yield ctx
