"""Attention half of ``P2pAFDConnector`` (alias ``P2pNcclAFDConnector``).

torch.distributed point-to-point: Gloo on CPU, NCCL on CUDA (``connector_extra_config.backend``
overrides). Rank layout and the A:F mapping: ``afd_common.topology``; message layout:
``afd_common.p2p_wire``.
"""

from __future__ import annotations

import torch

from afd_common.metadata import LayerCall
from afd_common.p2p_wire import PROTOCOL, data_tag, open_p2p_world, pack
from afd_common.sync_connector import SyncAttentionConnector


class P2pAttentionConnector(SyncAttentionConnector):
    protocol = PROTOCOL

    def _open(self):
        return open_p2p_world(self)

    def send_attn_output(self, hidden_states, call, topk_ids=None, topk_weights=None) -> None:
        net = self._require_net()
        rows = self._check_send(hidden_states, call, topk_ids, topk_weights)
        out = torch.empty_like(hidden_states)
        pending = []
        start = 0
        tag = data_tag(call.layer_idx, call.stage)
        for link in self._links:
            n = self.topology.chunk_rows(link, rows)
            if n == 0:
                continue
            sl = slice(start, start + n)
            start += n
            msg = pack(hidden_states[sl], topk_ids[sl] if topk_ids is not None else None,
                       topk_weights[sl] if topk_weights is not None else None)
            dst = self.topology.ffn_global_rank(link.ffn_rank)
            # Post the receive of the result before sending: the reply can land while this side
            # computes the next stage.
            pending.append(net.data.irecv(out[sl], dst, tag, (
                "the FFN result of layer {} stage {}", call.layer_idx, call.stage)))
            net.data.isend(msg, dst, tag)
        self._inflight[call] = (out, pending)

    def recv_ffn_output(self, call: LayerCall) -> torch.Tensor:
        out, pending = self._pop_inflight(call)
        net = self._net
        for p in pending:
            net.data.wait(p, self.timeouts.current())
        return out
