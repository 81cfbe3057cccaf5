"""While a role builds its model: what it loaded, counted before vLLM puts the weights into kernel
formats.

vLLM's CPU linear layers repack their weights for oneDNN or SGL kernels after loading and leave an
empty parameter behind, so counting parameters afterwards misses them (a DeepSeek-V2 attention
role looked as if it held no dense MLP or shared expert). The count is taken in vLLM's load path,
just before ``process_weights_after_loading``. Installed only around model construction.
"""

from __future__ import annotations

from collections.abc import Callable

from afd_common.patching import PatchSet


def build(record: Callable[[object], None]) -> PatchSet:
    """``record(model)`` runs once the checkpoint is loaded, before any repacking."""
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading

    def process_weights_after_loading(model, model_config, target_device):
        record(model)
        return original(model, model_config, target_device)

    return PatchSet("weight_census").setattr(base_loader, "process_weights_after_loading",
                                             process_weights_after_loading)
