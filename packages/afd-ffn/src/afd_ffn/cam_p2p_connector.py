"""FFN half of ``CAMP2pAFDConnector`` (Ascend, sync).

Driven by the scheduled loop like the P2P connector: the control plane gives each stage's rows per
attention rank, ``afd_ascend.a2e`` brings them (and says how many each source sent, checked
against the plan), ``afd_ascend.e2a`` returns the results. World layout and mapping:
``afd_common.transport.cam``.
"""

from __future__ import annotations

import torch

from afd_common.transport.cam import CAMP2pHalf, op_error
from afd_common.errors import AFDProtocolError
from afd_common.metadata import WorkItem, WorkItemMeta
from afd_common.contract import ScheduledFFNConnector


class CAMP2pFFNConnector(CAMP2pHalf, ScheduledFFNConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        served = [link.attention_rank for link in self._links]
        self._peer = f"attention rank{'s' if len(served) > 1 else ''} " + \
            ", ".join(map(str, served))

    def _on_step(self, plan) -> None:
        super()._on_step(plan)
        self._release_sends()

    def recv_layer(self, stage_idx, layer_idx, max_num_tokens=None) -> WorkItem:
        sources = self._stage_sources(stage_idx, max_num_tokens, layer_idx)
        shape, gate = self.shape, self.config.compute_gate_on_attention
        total = sum(n for _, n in sources)
        k = shape.top_k if gate else 0
        dev = self.device
        try:
            x, ids, weights, counts, _ = torch.ops.afd_ascend.a2e(
                torch.empty(0, shape.hidden_size, dtype=shape.dtype, device=dev),
                torch.empty(0, k, dtype=torch.int32, device=dev) if gate else None,
                torch.empty(0, k, dtype=torch.float32, device=dev) if gate else None,
                batch_size=total, compute_gate=int(gate), **self._op_args(stage_idx))
        except RuntimeError as e:
            raise op_error(e, f"hidden states of layer {layer_idx} stage {stage_idx}",
                           self._peer) from None
        got = counts.tolist()
        if self._owner is not None:  # sharded: the announced tokens bound what the routing sent
            over = [(a, g, n) for (a, n), g in zip(sources, got) if g > n]
            if over:
                a, g, n = over[0]
                raise AFDProtocolError(f"layer {layer_idx} stage {stage_idx}: attention rank {a} "
                                       f"sent {g} rows, more than the {n} tokens it announced")
            sources = tuple((a, g) for (a, _), g in zip(sources, got))
        elif got != [n for _, n in sources]:
            raise AFDProtocolError(f"layer {layer_idx} stage {stage_idx}: the attention ranks "
                                   f"{[a for a, _ in sources]} sent {got} rows, the control "
                                   f"plane announced {[n for _, n in sources]}")
        meta = WorkItemMeta(layer_idx=layer_idx, stage=stage_idx, step=self._plan.step,
                            sources=sources, kind=self._plan.kind)
        return self.work_item(x, meta, ids if gate else None, weights if gate else None,
                              handle=counts)

    def send_ffn_output(self, output: torch.Tensor, item: WorkItem) -> None:
        self._check_output(output, item.num_tokens)
        try:
            torch.ops.afd_ascend.e2a(output, item.handle, batch_size=item.num_tokens,
                                     **self._op_args(item.meta.stage))
        except RuntimeError as e:
            raise op_error(e, f"returning layer {item.meta.layer_idx} stage {item.meta.stage}",
                           self._peer) from None
