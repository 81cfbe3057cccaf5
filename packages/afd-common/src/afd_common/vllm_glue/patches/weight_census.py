"""While a role builds its model: what it loaded, counted before vLLM puts the weights into kernel
formats.

vLLM's CPU linear layers repack their weights for oneDNN or SGL kernels after loading and leave an
empty parameter behind, so counting parameters afterwards misses them (a DeepSeek-V2 attention
role looked as if it held no dense MLP or shared expert). The count is taken in vLLM's load path,
just before ``process_weights_after_loading``. Installed only around model construction.
"""

from __future__ import annotations

from afd_common.vllm_glue.patching import PatchSet
from afd_common.vllm_glue.model import weight_summary


def build(held: dict) -> PatchSet:
    """``held`` gets the loaded model's ``weight_summary`` before any repacking (it stays
    empty with a loader that does not go through vLLM's base loader)."""
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading

    def process_weights_after_loading(model, model_config, target_device):
        held.update(weight_summary(model))
        return original(model, model_config, target_device)

    return PatchSet("weight_census").setattr(base_loader, "process_weights_after_loading",
                                             process_weights_after_loading)
