"""What an FFN-side forward pass knows about itself: the forward context of one work item.

The FFN role runs one MoE layer's experts per work item, outside any vLLM step. vLLM's MoE code
reads the forward context, so each item gets one -- with no DP metadata (an FFN rank computes its
rows alone; building DP metadata would all-reduce with FFN ranks that are busy with other items)
and with ``afd_metadata``: the item's layer index, stage and token count, which async connectors
read off the wire rather than from a step schedule.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from afd_common.metadata import WorkItem


@dataclass(frozen=True)
class AFDForwardMetadata:
    layer_idx: int
    stage: int
    num_tokens: int
    sources: tuple[tuple[int, int], ...]


@contextmanager
def ffn_forward_context(vllm_config, item: WorkItem):
    from vllm.forward_context import get_forward_context, set_forward_context

    n = item.num_tokens
    dp = vllm_config.parallel_config.data_parallel_size
    # Given counts keep vLLM from all-reducing them across DP ranks; the metadata is dropped.
    across = torch.full((dp,), n, dtype=torch.int32) if dp > 1 else None
    with set_forward_context(None, vllm_config, num_tokens=n, num_tokens_across_dp=across):
        ctx = get_forward_context()
        ctx.dp_metadata = None
        ctx.afd_metadata = AFDForwardMetadata(item.layer_idx, item.meta.stage, n,
                                              item.meta.sources)
        yield ctx


def current() -> AFDForwardMetadata | None:
    """The AFD metadata of the forward pass running now, if it is an FFN work item."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    return getattr(get_forward_context(), "afd_metadata", None)
