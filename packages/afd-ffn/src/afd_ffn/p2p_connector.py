"""FFN half of ``P2pAFDConnector`` (alias ``P2pNcclAFDConnector``).

Driven by the scheduled loop: the control plane says how many rows each served attention rank has per
stage, so every receive is posted with its exact size. With sharded experts that is an upper
bound: each attention rank's row count for this layer comes first, and a count above the bound is
refused before anything is allocated. Rank layout and the A:F mapping: ``afd_common.topology``;
message layout and the order on a link: ``afd_common.transport.p2p``.
"""

from __future__ import annotations

import torch

from afd_common.errors import AFDProtocolError
from afd_common.metadata import WorkItem, WorkItemMeta
from afd_common.transport.p2p import (PROTOCOL, count_tag, data_tag, empty_message, open_p2p_world,
                                 unpack)
from afd_common.contract import ScheduledFFNConnector


class P2pFFNConnector(ScheduledFFNConnector):
    protocol = PROTOCOL

    def _open(self):
        return open_p2p_world(self)

    def recv_layer(self, stage_idx, layer_idx, max_num_tokens=None) -> WorkItem:
        sources = self._stage_sources(stage_idx, max_num_tokens, layer_idx)
        net, plan = self._net, self._plan
        shape, gate = self.shape, self.config.compute_gate_on_attention
        tag = data_tag(layer_idx, stage_idx)
        if self.topology.sharded:
            sources = self._routed_counts(sources, layer_idx, stage_idx)
        pending = []
        for a, n in sources:
            if n:
                buf = empty_message(n, shape.hidden_size, shape.dtype, shape.top_k, gate,
                                    self.device)
                pending.append((n, net.data.irecv(
                    buf, self.topology.attention_global_rank(a), tag,
                    ("hidden states of layer {} stage {}", layer_idx, stage_idx))))
        parts = [unpack(net.data.wait(p, self.timeouts.current()), n, shape.hidden_size,
                        shape.dtype, shape.top_k, gate) for n, p in pending]
        meta = WorkItemMeta(layer_idx=layer_idx, stage=stage_idx, step=plan.step,
                            sources=sources, kind=plan.kind)
        if len(parts) == 1:
            hidden, ids, weights = parts[0]
        elif parts:
            hidden = torch.cat([p[0] for p in parts])
            ids = torch.cat([p[1] for p in parts]) if gate else None
            weights = torch.cat([p[2] for p in parts]) if gate else None
        else:
            hidden = torch.empty(0, shape.hidden_size, dtype=shape.dtype, device=self.device)
            ids = (torch.empty(0, shape.top_k, dtype=torch.int32, device=self.device)
                   if gate else None)
            weights = (torch.empty(0, shape.top_k, dtype=torch.float32, device=self.device)
                       if gate else None)
        return self.work_item(hidden, meta, ids, weights)

    def _routed_counts(self, bounds, layer_idx: int, stage_idx: int):
        """(attention rank, rows routed here) for this layer, each checked against the rows that
        rank announced for the stage."""
        net, ctag = self._net, count_tag(layer_idx, stage_idx)
        what = ("the row count of layer {} stage {}", layer_idx, stage_idx)
        # On the data plane's device (NCCL moves device tensors); reading it back is the one
        # host sync a sharded layer needs: the rows' receive is posted with their size.
        posted = [(a, bound, net.data.irecv(torch.empty(1, dtype=torch.int64, device=self.device),
                                            self.topology.attention_global_rank(a), ctag, what))
                  for a, bound in bounds]
        out = []
        for a, bound, pending in posted:
            n = int(net.data.wait(pending, self.timeouts.current())[0])
            if not 0 <= n <= bound:
                raise AFDProtocolError(
                    f"attention rank {a} announced {n} rows for layer {layer_idx} stage "
                    f"{stage_idx}, outside [0, {bound}] (its tokens in this stage)")
            out.append((a, n))
        return tuple(out)

    def send_ffn_output(self, output: torch.Tensor, item: WorkItem) -> None:
        self._check_output(output, item.num_tokens)
        net = self._net
        tag = data_tag(item.meta.layer_idx, item.meta.stage)
        output = output.contiguous()
        sources = item.meta.sources
        if len(sources) == 1:  # one attention rank's rows: no view to cut
            a, n = sources[0]
            if n:
                net.data.isend(output, self.topology.attention_global_rank(a), tag)
            return
        start = 0
        for a, n in sources:
            if n:
                net.data.isend(output[start:start + n], self.topology.attention_global_rank(a),
                               tag)
                start += n
