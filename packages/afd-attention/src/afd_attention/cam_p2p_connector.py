"""Attention half of ``CAMP2pAFDConnector`` (Ascend, sync).

Hidden states (and routing, with the gate on attention) go out through ``afd_ascend.a2e`` and the
results come back through ``afd_ascend.e2a`` (with sharded experts: to and from every FFN rank
that owns one of a row's experts), one registered group per micro-batch stage; step
metadata goes once per step over the Gloo control plane. On an NPU the ops ride HCCL through
torch-npu (not exercised here); on CPU the portable kernels ride Gloo. World layout and mapping:
``afd_common.transport.cam``.
"""

from __future__ import annotations

import torch

from afd_common import metrics
from afd_common.transport.cam import CAMP2pHalf, op_error
from afd_common.contract import AttentionConnector


class CAMP2pAttentionConnector(CAMP2pHalf, AttentionConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ffn_rank = self.local_rank % self.config.num_ffn_ranks
        self._peer = f"FFN rank {self._ffn_rank}"
        self._rec = metrics.recorder("attention", self.config.connector)

    def begin_step(self, meta) -> None:
        super().begin_step(meta)
        self._release_sends()

    def send_attn_output(self, hidden_states, call, topk_ids=None, topk_weights=None):
        rows = self._check_send(hidden_states, call, topk_ids, topk_weights)
        gate = topk_ids is not None
        try:
            *_, counts, routed = torch.ops.afd_ascend.a2e(
                hidden_states, topk_ids.to(torch.int32) if gate else None,
                topk_weights.to(torch.float32) if gate else None, batch_size=rows,
                compute_gate=int(gate), **self._op_args(call.stage))
        except RuntimeError as e:
            raise op_error(e, f"sending layer {call.layer_idx} stage {call.stage}",
                           self._peer) from None
        if self._owner is None:
            self._rec.routed(self._ffn_rank, rows)
            return self._pending(call, (rows, None))
        else:  # sharded: rows per FFN rank, and which ranks each row went to
            self._rec.routed_per_rank(counts)
            return self._pending(call, (rows, routed))

    def recv_ffn_output(self, pending) -> torch.Tensor:
        rows, routed = self._take(pending)
        call = pending.call
        like = torch.empty(rows, self.shape.hidden_size, dtype=self.shape.dtype,
                           device=self.device)
        try:
            return torch.ops.afd_ascend.e2a(like, torch.tensor([rows]), batch_size=rows,
                                            routed_rows=routed, **self._op_args(call.stage))
        except RuntimeError as e:
            raise op_error(e, f"the FFN result of layer {call.layer_idx} stage {call.stage}",
                           self._peer) from None
