"""Attention half of ``P2pAFDConnector`` (alias ``P2pNcclAFDConnector``).

torch.distributed point-to-point: Gloo on CPU, NCCL on CUDA (``connector_extra_config.backend``
overrides). Rank layout and the A:F mapping: ``afd_common.topology``; message layout:
``afd_common.p2p_wire``.
"""

from __future__ import annotations

import torch

from afd_common.contract import AttentionConnector, ControlPlane
from afd_common.metadata import LayerCall, StepKind, StepMetadata
from afd_common.p2p_wire import PROTOCOL, WATCH_TAG, SyncLinks, data_tag, open_p2p_world, pack
from afd_common.transport import PendingRecv


class P2pAttentionConnector(AttentionConnector):
    protocol = PROTOCOL

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._links = self.topology.links_of_attention(self.local_rank)
        self._net: SyncLinks | None = None
        self._step: StepMetadata | None = None
        self._inflight: dict[LayerCall, tuple[torch.Tensor, list[PendingRecv]]] = {}

    @property
    def control_plane(self) -> ControlPlane | None:
        return self._net.control if self._net else None

    def init(self) -> None:
        if self._net is None:
            self._net = open_p2p_world(self)

    def watch_peers(self, on_lost) -> None:
        net = self._require_net()
        peers = [self.topology.ffn_global_rank(link.ffn_rank) for link in self._links]
        net.data.watch(peers, WATCH_TAG, lambda peer, reason: on_lost(reason))

    def begin_step(self, meta: StepMetadata) -> None:
        self._require_net()
        if self._inflight:
            raise RuntimeError(f"step {meta.step} begins with results of the previous step "
                               f"still unreceived: {sorted(self._inflight)}")
        self._step = meta
        super().begin_step(meta)

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
        net = self._require_net()
        try:
            out, pending = self._inflight.pop(call)
        except KeyError:
            raise RuntimeError(f"recv_ffn_output({call}) without a matching send_attn_output; "
                               f"in flight: {sorted(self._inflight)}") from None
        for p in pending:
            net.data.wait(p, self.timeouts.current())
        return out

    def close(self) -> None:
        net, self._net = self._net, None
        if net is None:
            return
        net.data.closing = net.control.io.closing = True
        try:
            if not self._inflight:
                # Tell the FFN side we are done so its runner ends cleanly instead of timing out.
                net.control.send_step(StepMetadata(self._next_step(), StepKind.STOP,
                                                   (0,) * self.config.extra.num_micro_batches))
                net.control.io.flush(min(5.0, self.timeouts.step_s))
        except Exception:  # noqa: BLE001 - the peer may already be gone; closing must not fail
            pass
        finally:
            self._inflight.clear()
            net.world.close()

    def _next_step(self) -> int:
        return self._step.step + 1 if self._step else 0

    def _require_net(self) -> SyncLinks:
        if self._net is None:
            raise RuntimeError(f"{type(self).__name__} used before init() or after close()")
        return self._net

    def _check_send(self, hidden, call, topk_ids, topk_weights) -> int:
        shape, step = self.shape, self._step
        if step is None:
            raise RuntimeError("send_attn_output before begin_step")
        shape.check_layer(call.layer_idx)
        if not 0 <= call.stage < step.num_stages:
            raise ValueError(f"stage {call.stage} out of range: step {step.step} has "
                             f"{step.num_stages} stages")
        if call in self._inflight:
            raise RuntimeError(f"{call} sent twice without receiving its result")
        if hidden.dim() != 2 or hidden.shape[1] != shape.hidden_size:
            raise ValueError(f"hidden states of shape {tuple(hidden.shape)}: expected "
                             f"[tokens, {shape.hidden_size}] (hidden_size)")
        if hidden.dtype != shape.dtype:
            raise ValueError(f"hidden states of dtype {hidden.dtype}: this AFD world moves "
                             f"{shape.dtype}")
        rows = hidden.shape[0]
        if rows != step.stage_tokens[call.stage]:
            raise ValueError(f"layer {call.layer_idx} stage {call.stage}: {rows} rows, but step "
                             f"{step.step} announced {step.stage_tokens[call.stage]}")
        gate = self.config.compute_gate_on_attention
        if gate != (topk_ids is not None) or (topk_ids is None) != (topk_weights is None):
            raise ValueError("topk_ids/topk_weights must be given exactly when "
                             f"compute_gate_on_attention is true (it is {gate})")
        if topk_ids is not None:
            want = (rows, shape.top_k)
            if tuple(topk_ids.shape) != want or tuple(topk_weights.shape) != want:
                raise ValueError(f"routing of shapes {tuple(topk_ids.shape)} / "
                                 f"{tuple(topk_weights.shape)}: expected {want} (tokens, top_k)")
        return rows
