"""FFN half of ``CAMAsyncAFDConnector`` (Ascend, async DP): the receive is the clock.

``recv_next`` returns whatever ``afd_ascend.afd_async_dispatch_recv`` delivers next: one
attention DP group's rows for one layer (or part of them, when they exceed the capacity), each
row a (token, expert) pair for one of this rank's local experts. The layer index comes off the
wire. The item routes each row to its expert with weight 1 (``topk_ids`` [rows, 1] global expert
ids); ``send_ffn_output`` returns the rows through ``afd_async_combine_send`` and the attention
side weights and sums them. Stop items from every attention DP group end the loop.
"""

from __future__ import annotations

import torch

from afd_common.transport.cam import ATTENTION_TP as TP_SIZE, CAMAsyncHalf, op_error, release_sends
from afd_common.contract import StreamingFFNConnector
from afd_common.errors import AFDProtocolError
from afd_common.metadata import StepKind, WorkItem, WorkItemMeta


class CAMAsyncFFNConnector(CAMAsyncHalf, StreamingFFNConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._groups = self.config.num_attention_ranks // TP_SIZE
        self._stopped: set[int] = set()
        self._items = 0
        self._templates: dict[int, torch.Tensor] = {}
        # This rank's global expert ids, once per DP group member (batch_info's count layout).
        mine = self.shape.placement.local_experts(self.local_rank)  # check_cam_async: R of them
        self._member_experts = torch.tensor(mine, dtype=torch.int32).repeat(TP_SIZE)

    def _args(self) -> dict:
        return dict(moe_rank_id=self.topology.ffn_global_rank(self.local_rank), tp_size=TP_SIZE,
                    **self._op_args())

    def recv_next(self, stage_idx=0, max_num_tokens=None) -> WorkItem:
        """``max_num_tokens``: the capacity in rows. The default is the most rows one local
        expert can get from one DP group (each token picks an expert once), so no expert ever
        overflows; a larger group arrives as several items."""
        shape = self.shape
        cap = max_num_tokens or TP_SIZE * shape.max_num_tokens
        like = self._templates.get(cap)
        if like is None:  # the op reads only its dtype and row count: allocated once per size
            like = self._templates[cap] = torch.empty(cap, shape.hidden_size, dtype=shape.dtype,
                                                      device=self.device)
        while True:
            try:
                x, scales, _, info = torch.ops.afd_ascend.afd_async_dispatch_recv(
                    like, self._comm_args, comm_id=stage_idx, max_seq_len=shape.max_num_tokens,
                    dynamic_quant=self._quant, **self._args())
            except RuntimeError as e:
                raise op_error(e, f"hidden states of stage {stage_idx}",
                               "the attention ranks") from None
            n, source, layer = (int(v) for v in info[:3].tolist())
            if source >= 0:
                break
            self._stopped.add(int(info[3]))  # a stop item names its DP group's first rank
            if len(self._stopped) == self._groups:
                meta = WorkItemMeta(layer_idx=-1, stage=stage_idx, step=self._items, sources=(),
                                    is_stop=True, kind=StepKind.STOP)
                return WorkItem(x[:0], meta)
        try:
            self.shape.check_layer(layer)
        except ValueError as e:
            raise AFDProtocolError(f"attention rank {source}: {e}") from None
        # This attention rank sends a layer's rows only after it received every result of its
        # last layer (one micro-batch: check_cam_async), so it has all we sent it before.
        release_sends(self._net.name, self.topology.global_rank("attention", source))
        rows = x[:n]
        if self._quant:
            rows = (rows.to(torch.float32) * scales[:n, None]).to(shape.dtype)
        per_member = info[5 + TP_SIZE:].view(TP_SIZE, self._R)
        ids = torch.repeat_interleave(self._member_experts, per_member.flatten())
        meta = WorkItemMeta(layer_idx=layer, stage=stage_idx, step=self._items,
                            sources=((source, n),))
        self._items += 1
        return WorkItem(rows, meta, ids.view(-1, 1).to(self.device),
                        torch.ones(n, 1, dtype=torch.float32, device=self.device), handle=info)

    def send_ffn_output(self, output: torch.Tensor, item: WorkItem) -> None:
        want = (item.num_tokens, self.shape.hidden_size)
        if tuple(output.shape) != want or output.dtype != self.shape.dtype:
            raise ValueError(f"FFN output of shape {tuple(output.shape)} {output.dtype}: "
                             f"expected {want} {self.shape.dtype}")
        if item.num_tokens == 0:
            return  # nothing to return; the attention side expects no rows from this rank
        try:
            torch.ops.afd_ascend.afd_async_combine_send(
                output.contiguous(), self._comm_args, item.handle, comm_id=item.meta.stage,
                max_seq_len=self.shape.max_num_tokens, **self._args())
        except RuntimeError as e:
            raise op_error(e, f"returning layer {item.layer_idx}",
                           f"attention rank {item.meta.sources[0][0]}") from None
