"""While the attention role builds its model: vLLM's MoE runner and routed experts become the
AFD ones (``afd_attention.remote_moe``), through vLLM's out-of-tree layer registry. Installed
only around model construction, so nothing else in the process is affected."""

from __future__ import annotations

from afd_common.patching import PatchSet


def build() -> PatchSet:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    from afd_attention.remote_moe import AFDAttentionMoERunner, AFDRemoteRoutedExperts

    return (PatchSet("attention_remote_moe")
            .setitem(op_registry_oot, MoERunner.__name__, AFDAttentionMoERunner)
            .setitem(op_registry_oot, RoutedExperts.__name__, AFDRemoteRoutedExperts))
