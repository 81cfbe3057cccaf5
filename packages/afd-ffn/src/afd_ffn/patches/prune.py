"""While the FFN role builds its model: everything but the MoE blocks becomes an empty
placeholder, so the FFN role never allocates or reads attention, dense-MLP, shared-expert,
embedding or LM-head weights, and vLLM sees no attention layer (hence no KV cache).

Placeholders are vLLM's ``PPMissingLayer``, which every checkpoint loader already skips. Installed
only around model construction.
"""

from __future__ import annotations

from torch import nn

from afd_common.vllm_glue.models import ARCHITECTURES
from afd_common.vllm_glue.patching import PatchSet


def build() -> PatchSet:
    import importlib

    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                     VocabParallelEmbedding)
    from vllm.model_executor.models.utils import PPMissingLayer

    class PrunedLayer(PPMissingLayer):
        """Runs on the attention role."""

    class PrunedEmbedding(PPMissingLayer, VocabParallelEmbedding):
        def __init__(self, *args, **kwargs):
            nn.Module.__init__(self)

    class PrunedLMHead(PPMissingLayer, ParallelLMHead):
        def __init__(self, *args, **kwargs):
            nn.Module.__init__(self)

    patch = PatchSet("ffn_prune")
    # DeepSeek V2 and V3 share a module: each class once.
    for module_name, path in sorted({(a.vllm_module, c) for a in ARCHITECTURES.values()
                                     for c in a.attention_only}):
        owner = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        patch.setattr(owner, name, PrunedLayer)
    patch.setitem(op_registry_oot, VocabParallelEmbedding.__name__, PrunedEmbedding)
    patch.setitem(op_registry_oot, ParallelLMHead.__name__, PrunedLMHead)
    return patch
