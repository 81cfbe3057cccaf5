"""Attention half of ``P2pAFDConnector`` (alias ``P2pNcclAFDConnector``).

torch.distributed point-to-point: Gloo on CPU, NCCL on CUDA (``connector_extra_config.backend``
overrides). Rank layout and the A:F mapping: ``afd_common.topology``; message layout and the order
of operations on a link: ``afd_common.transport.p2p``.

Where every row of this rank goes to one FFN rank over Gloo, the round trip is compiled
(``afd_common.transport.one_link``); the Python below serves every other case, and names what is
wrong with a call the compiled path refuses.

Replicated experts: this rank's rows go to its FFN peer(s) as the topology splits them. Sharded
experts (M2N): a row goes to every FFN rank that owns one of its top-k experts, after a row
count; the partial results come back from each and are added in FFN-rank order.
"""

from __future__ import annotations

import torch

from afd_common import metrics
from afd_common.metadata import LayerCall, StepMetadata, new_tuple
from afd_common.transport import codec
from afd_common.transport.control_plane import CONTROL_TAG
from afd_common.transport import one_link
from afd_common.transport.one_link import LinkError
from afd_common.transport.p2p import (PROTOCOL, DataTags, count_tag, data_tag, open_p2p_world,
                                      pack)
from afd_common.transport.peer_io import PendingRecv
from afd_common.contract import AttentionConnector, PendingResult


class P2pAttentionConnector(AttentionConnector):
    protocol = PROTOCOL
    backend: str | None = None  # the configured one (open_p2p_world)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._links = self.topology.links_of_attention(self.local_rank)
        # The FFN rank that gets all of this rank's rows, if one does (replicated, A >= F), and
        # the FFN side computes the routing.
        one = (len(self._links) == 1 and self._links[0].num_chunks == 1
               and not self.topology.sharded and not self.config.compute_gate_on_attention)
        self._one_link = self._links[0].ffn_rank if one else None
        self._one_dst = self.topology.ffn_global_rank(self._one_link) if one else None
        self._rec = metrics.recorder("attention", self.config.connector)
        self._tags = DataTags()
        # Rows sent to that one FFN rank since the last end_step (metrics, counted there).
        self._one_rows = 0
        # The one-FFN-rank path's next result tensor, allocated while the previous result is
        # awaited: off the path from a result to the next send, and the reply's receive follows its
        # send at once (PeerIO.send_then_post). Allocating it between the two measured slower at
        # every size (six alternating runs of benchmarks/transport.py: by 0.14x of raw Gloo at 512
        # tokens); allocating it before the send put 5 us on that path (--breakdown).
        self._spare: torch.Tensor | None = None
        # That path compiled, where it can serve (afd_common.transport.one_link): a call it took
        # has the link as its PendingResult's state.
        self._compiled = None

    def _open(self):
        net = open_p2p_world(self, self.backend)
        if self._one_dst is not None:
            link = self._compiled = one_link.attention_link(net.data, self._one_dst, self.shape)
            if link is not None:
                # The plans too, where the control plane's frames share the rows' group.
                shared = net.control.io is net.data
                one_link.serve(self, link, self._link_failure, PendingResult, self._inflight,
                               self.shape.max_num_tokens, CONTROL_TAG if shared else -1,
                               StepMetadata, self._plan_failure, *codec.STEP_FRAME)
        return net

    def begin_step(self, meta) -> None:
        super().begin_step(meta)
        if self._compiled is not None:
            self._compiled.begin(meta.stage_tokens)

    def end_step(self) -> None:
        super().end_step()
        self._spare = None  # not held between steps: it may be as large as a prefill's rows
        if self._compiled is not None:
            self._one_rows += self._compiled.end_step()
        if self._one_rows:
            self._rec.routed(self._one_link, self._one_rows)
            self._one_rows = 0

    def send_attn_output(self, hidden_states, call, topk_ids=None, topk_weights=None):
        link = self._compiled
        if link is None:
            rows = self._check_send(hidden_states, call, topk_ids, topk_weights)
        else:
            if topk_ids is None and call not in self._inflight:  # else sent by Python already
                try:
                    if link.send(hidden_states, *call):
                        return new_tuple(PendingResult, (call, link))
                except LinkError as e:
                    raise self._link_failure(e, call) from None
            # Refused there: named here, or a call the compiled path does not take (a strided
            # tensor).
            rows = self._check_send_one_by_one(hidden_states, call, topk_ids, topk_weights)
        dst = self._one_dst
        if dst is not None and rows and hidden_states.is_contiguous():
            # Every row to one FFN rank (the routing, if any, is computed there): the one
            # receive is the state.
            out = self._spare
            if out is None or out.shape != hidden_states.shape:
                out = torch.empty_like(hidden_states)
            self._spare = None
            tag = self._tags[call]
            pending = self._net.data.send_then_post(
                hidden_states, dst, tag, out, dst, tag, ("the FFN result of layer {} stage {}",
                                                         *call))
            self._one_rows += rows
            return self._pending(call, pending)
        net = self._net
        if self.topology.sharded:
            return self._pending(call, self._send_sharded(net, call, rows, hidden_states,
                                                          topk_ids, topk_weights))
        tag = self._tags[call]
        what = ("the FFN result of layer {} stage {}", *call)
        # The results' tensor before any send, so that receives follow sends at once
        # (PeerIO.send_then_post); contiguous whatever the rows' strides, as a receive needs.
        out = hidden_states.new_empty(hidden_states.shape)
        if not rows:
            return self._pending(call, (out, ()))
        sent = []
        start = 0
        for link in self._links:
            n = self.topology.chunk_rows(link, rows)
            if n == 0:
                continue
            sl = slice(start, start + n)
            start += n
            dst = self.topology.ffn_global_rank(link.ffn_rank)
            net.data.isend(pack(hidden_states[sl],
                                topk_ids[sl] if topk_ids is not None else None,
                                topk_weights[sl] if topk_weights is not None else None), dst, tag)
            sent.append((link.ffn_rank, dst, sl, n))
        pending = []
        # Each reply's receive after the send to its FFN rank: on NCCL/HCCL a receive posted
        # first would hold back the send behind it (in-order matching per pair).
        for ffn_rank, dst, sl, n in sent:
            pending.append(net.data.irecv(out[sl], dst, tag, what))
            self._rec.routed(ffn_rank, n)
        return self._pending(call, (out, pending))

    def _send_sharded(self, net, call, rows, hidden, topk_ids, topk_weights):
        tag, ctag = data_tag(call.layer_idx, call.stage), count_tag(call.layer_idx, call.stage)
        what = ("a partial FFN result of layer {} stage {}", call.layer_idx, call.stage)
        owners = self.shape.placement.owner_table.to(topk_ids.device)[topk_ids.long()]
        parts = []
        for f in range(self.topology.num_ffn_ranks):
            sel = (owners == f).any(dim=1).nonzero().squeeze(1)
            n = sel.numel()
            dst = self.topology.ffn_global_rank(f)
            net.data.isend(torch.tensor([n], dtype=torch.int64, device=hidden.device), dst, ctag)
            if n:
                buf = hidden.new_empty(n, hidden.shape[1])
                net.data.isend(pack(hidden.index_select(0, sel), topk_ids.index_select(0, sel),
                                    topk_weights.index_select(0, sel)), dst, tag)
                parts.append((sel, net.data.irecv(buf, dst, tag, what)))
                self._rec.routed(f, n)
        return rows, hidden, parts

    def recv_ffn_output(self, pending) -> torch.Tensor:
        call, state = pending
        if state is self._compiled and state is not None:
            try:
                out = state.recv(*call, self.timeouts.current_s)
            except LinkError as e:
                raise self._link_failure(e, call) from None
            if out is not None:
                return out
        state = self._take(pending)
        net = self._net
        timeout = self.timeouts.current_s
        if type(state) is PendingRecv:  # one FFN rank's reply: the result
            # The next call's result tensor, while this one's is awaited (``_spare``).
            self._spare = torch.empty_like(state.tensor)
            return net.data.wait(state, timeout)
        if self.topology.sharded:
            rows, like, parts = state
            out = like.new_zeros(rows, like.shape[1])
            for sel, pending in parts:  # FFN-rank order: the same sum on every run
                out.index_add_(0, sel, net.data.wait(pending, timeout))
            return out
        out, pending = state
        for p in pending:
            net.data.wait(p, timeout)
        return out

    def _plan_failure(self, e: LinkError) -> Exception:
        """A plan's send or the settling of the sends before it failed (the compiled link's
        ``begin_step``): worded as the control plane's PeerIO words it."""
        return one_link.failure(self._net, e, self._one_dst, None, self.timeouts.current_s)

    def _link_failure(self, e: LinkError, call: LayerCall) -> Exception:
        return one_link.failure(self._net, e, self._one_dst,
                                ("the FFN result of layer {} stage {}", *call),
                                self.timeouts.current_s)

    def _unreceived(self) -> list[LayerCall]:
        compiled = self._compiled
        if compiled is None or not compiled.num_in_flight():  # each step's begin asks
            return super()._unreceived()
        return sorted(self._inflight | {LayerCall(*c) for c in compiled.in_flight()})

    def _in_flight(self, call: LayerCall) -> bool:
        compiled = self._compiled
        return call in self._inflight or (compiled is not None and compiled.holds(*call))

    def _release(self, net) -> None:
        # The class's methods first: one called meanwhile says the connector is closed.
        one_link.unserve(self)
        try:
            super()._release(net)
        finally:
            link, self._compiled = self._compiled, None
            if link is not None:
                link.drop()
