"""While the attention role builds its model: vLLM's MoE runner and routed experts become the
AFD ones (``afd_attention.remote_moe``), through vLLM's out-of-tree layer registry, and the
checkpoint's routed-expert tensors are dropped before the model's loader sees them (they belong
to the FFN role; not every model's loader skips a weightless layer's names). Installed only around
model construction, so nothing else in the process is affected."""

from __future__ import annotations

import importlib

from afd_common.vllm_glue.models import ARCHITECTURES, is_routed_expert
from afd_common.vllm_glue.patching import PatchSet


def build() -> PatchSet:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from afd_attention.remote_moe import AFDAttentionMoERunner, AFDRemoteRoutedExperts

    all_weights = DefaultModelLoader.get_all_weights

    def get_all_weights(self, model_config, model):
        return ((name, tensor) for name, tensor in all_weights(self, model_config, model)
                if not is_routed_expert(name))

    patch = (PatchSet("attention_remote_moe")
             .setitem(op_registry_oot, MoERunner.__name__, AFDAttentionMoERunner)
             .setitem(op_registry_oot, RoutedExperts.__name__, AFDRemoteRoutedExperts)
             .setattr(DefaultModelLoader, "get_all_weights", get_all_weights))
    # A model's own RoutedExperts subclass: vLLM initialises what the registry returns only if it
    # is an instance of the class asked for, so the remote one subclasses it too.
    for arch in ARCHITECTURES.values():
        if arch.routed_experts is not None:
            own = getattr(importlib.import_module(arch.vllm_module), arch.routed_experts)
            remote = type(f"AFDRemote{own.__name__}", (AFDRemoteRoutedExperts, own), {})
            patch.setitem(op_registry_oot, own.__name__, remote)
    return patch
