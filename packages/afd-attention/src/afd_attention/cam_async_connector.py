"""Attention half of ``CAMAsyncAFDConnector`` (Ascend, async DP).

No control plane: each MoE layer's hidden states and top-k routing go out through
``afd_ascend.afd_async_dispatch_send`` (its header carries the layer index and row counts) and the
weighted expert outputs come back through ``afd_ascend.afd_async_combine_recv``. The FFN side
serves whichever attention rank is ready, so this rank never waits for the others (async DP).
``routed_scaling_factor`` stays on this role, as for every connector. World layout and expert
sharding: ``afd_common.transport.cam``.
"""

from __future__ import annotations

import torch

from afd_common import metrics
from afd_common.transport.cam import ATTENTION_TP, CAMAsyncHalf, op_error, release_sends
from afd_common.contract import AttentionConnector

STOP_LAYER = -1


class CAMAsyncAttentionConnector(CAMAsyncHalf, AttentionConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._rec = metrics.recorder("attention", self.config.connector)
        # Owner rank of each expert, as the ops address it (check_cam_async): e // R.
        self._owner = torch.arange(self.shape.num_experts, device=self.device) // self._R

    def begin_step(self, meta) -> None:
        super().begin_step(meta)
        # The last step's results all came back, each sent after its rows were received.
        release_sends(self._net.name)

    def _dispatch(self, x, ids, stage: int, layer: int, net=None) -> None:
        torch.ops.afd_ascend.afd_async_dispatch_send(
            x, ids, self._comm_args, comm_id=stage,
            max_seq_len=max(self.shape.max_num_tokens, x.shape[0]), batch_size=x.shape[0],
            layer_index=layer, tp_size=ATTENTION_TP, dynamic_quant=self._quant,
            attn_rank_id=self.local_rank, **self._op_args(net))

    def send_attn_output(self, hidden_states, call, topk_ids=None, topk_weights=None):
        rows = self._check_send(hidden_states, call, topk_ids, topk_weights)
        ids = topk_ids.to(torch.int32)
        try:
            self._dispatch(hidden_states.contiguous(), ids, call.stage, call.layer_idx)
        except RuntimeError as e:
            raise op_error(e, f"dispatching layer {call.layer_idx} stage {call.stage}",
                           "the FFN ranks") from None
        self._rec.routed_per_rank(torch.bincount(self._owner[ids.flatten().long()],
                                                 minlength=self.config.num_ffn_ranks))
        return self._pending(call, (rows, ids, topk_weights.to(torch.float32)))

    def recv_ffn_output(self, pending) -> torch.Tensor:
        rows, ids, weights = self._take(pending)
        call = pending.call
        like = torch.empty(0, self.shape.hidden_size, dtype=self.shape.dtype, device=self.device)
        try:
            return torch.ops.afd_ascend.afd_async_combine_recv(
                like, ids, weights, self._comm_args, comm_id=call.stage, batch_size=rows,
                attn_rank_id=self.local_rank, **self._op_args())
        except RuntimeError as e:
            raise op_error(e, f"the expert outputs of layer {call.layer_idx} stage "
                              f"{call.stage}", "the FFN ranks") from None

    def _goodbye(self, net) -> None:
        """A stop header per stream ends the FFN side's receive loop cleanly; the op waits
        (bounded) until the FFN ranks took it."""
        net.io.closing = True
        empty = torch.empty(0, self.shape.hidden_size, dtype=self.shape.dtype, device=self.device)
        none = torch.empty(0, self.shape.top_k, dtype=torch.int32, device=self.device)
        for stage in range(self.config.extra.num_micro_batches):
            self._dispatch(empty, none, stage, STOP_LAYER, net)
