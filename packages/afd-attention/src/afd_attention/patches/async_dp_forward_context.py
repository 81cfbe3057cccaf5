"""Async DP for the attention role: a forward pass never meets the other DP ranks.

vLLM's ``set_forward_context`` builds DP metadata for MoE models with DP > 1 by all-reducing
every rank's token count. Async DP ranks run their steps independently (the FFN role serves
whichever rank is ready), so that all-reduce would wait for ranks that never come. While
installed, the forward context of a DP > 1 step gets no DP metadata and no collective; nothing
else changes. ``async_dp_engine`` already makes vLLM treat each attention DP rank as
independent; this patch keeps the forward context right even where a config still says DP > 1.

vLLM modules import ``set_forward_context`` by name, so the patch rebinds it in
``vllm.forward_context`` and in every loaded vLLM module that holds vLLM's function (all undone
by ``uninstall``). Installed by the attention runner, only with ``async_dp``.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from afd_common.vllm_glue.patching import PatchSet


def build() -> PatchSet:
    import vllm.forward_context as fc
    import vllm.v1.worker.gpu_model_runner  # noqa: F401 - the model runner's binding must exist

    original = fc.set_forward_context

    @contextmanager
    def set_forward_context(attn_metadata, vllm_config, num_tokens=None,
                            num_tokens_across_dp=None, *args, **kwargs):
        dp = vllm_config.parallel_config.data_parallel_size
        if dp > 1 and num_tokens_across_dp is None and num_tokens is not None:
            # Given counts skip vLLM's all-reduce; the metadata built from them is dropped.
            num_tokens_across_dp = torch.full((dp,), num_tokens, dtype=torch.int32)
        with original(attn_metadata, vllm_config, num_tokens, num_tokens_across_dp, *args,
                      **kwargs):
            if dp > 1:
                fc.get_forward_context().dp_metadata = None
            yield

    patch = PatchSet("async_dp_forward_context")
    for name, module in sorted(sys.modules.items()):
        if name.startswith("vllm") and module is not None and \
                getattr(module, "set_forward_context", None) is original:
            patch.setattr(module, "set_forward_context", set_forward_context)
    return patch
