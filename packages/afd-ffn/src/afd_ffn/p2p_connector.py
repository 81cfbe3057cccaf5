"""FFN half of ``P2pAFDConnector`` (alias ``P2pNcclAFDConnector``).

Driven by the sync runner: the control plane says how many rows each served attention rank has per
stage, so every receive is posted with its exact size. Rank layout and the A:F mapping:
``afd_common.topology``; message layout: ``afd_common.p2p_wire``.
"""

from __future__ import annotations

import torch

from afd_common.contract import ControlPlane, FFNConnector, StepPlan
from afd_common.metadata import WorkItem, WorkItemMeta
from afd_common.p2p_wire import PROTOCOL, SyncLinks, data_tag, empty_message, open_p2p_world, unpack


class P2pFFNConnector(FFNConnector):
    protocol = PROTOCOL

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._links = self.topology.links_of_ffn(self.local_rank)
        self._net: SyncLinks | None = None
        self._plan: StepPlan | None = None

    @property
    def control_plane(self) -> ControlPlane | None:
        return self._net.control if self._net else None

    def init(self) -> None:
        if self._net is None:
            self._net = open_p2p_world(self)

    def on_step(self, plan: StepPlan) -> None:
        self._plan = plan
        # (attention rank, rows) per stage, in batch order: the same for every layer of the step.
        self._sources = [tuple((link.attention_rank, self.topology.chunk_rows(
            link, plan.per_source[link.attention_rank].stage_tokens[stage]))
            for link in self._links) for stage in range(plan.num_stages)]

    def recv_ffn_work_item(self, stage_idx=0, max_num_tokens=None, *, layer_idx=None) -> WorkItem:
        net, plan = self._require_net(), self._plan
        if plan is None:
            raise RuntimeError("recv_ffn_work_item before recv_step")
        if layer_idx is None:
            raise ValueError(f"{type(self).__name__} is a sync connector: the runner passes "
                             "layer_idx")
        self.shape.check_layer(layer_idx)
        if not 0 <= stage_idx < plan.num_stages:
            raise ValueError(f"stage {stage_idx} out of range: step {plan.step} has "
                             f"{plan.num_stages} stages")
        shape, gate = self.shape, self.config.compute_gate_on_attention
        sources = self._sources[stage_idx]
        if max_num_tokens is not None and sum(n for _, n in sources) > max_num_tokens:
            raise ValueError(f"step {plan.step} stage {stage_idx} brings "
                             f"{sum(n for _, n in sources)} rows, more than max_num_tokens "
                             f"{max_num_tokens}")
        tag = data_tag(layer_idx, stage_idx)
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
        return WorkItem(hidden, meta, ids, weights)

    def send_ffn_output(self, output: torch.Tensor, item: WorkItem) -> None:
        net = self._require_net()
        want = (item.num_tokens, self.shape.hidden_size)
        if tuple(output.shape) != want or output.dtype != self.shape.dtype:
            raise ValueError(f"FFN output of shape {tuple(output.shape)} {output.dtype}: "
                             f"expected {want} {self.shape.dtype}")
        tag = data_tag(item.meta.layer_idx, item.meta.stage)
        output = output.contiguous()
        start = 0
        for a, n in item.meta.sources:
            if n:
                net.data.isend(output[start:start + n], self.topology.attention_global_rank(a),
                               tag)
                start += n

    def close(self) -> None:
        net, self._net = self._net, None
        if net is not None:
            try:
                net.data.flush(min(5.0, self.timeouts.step_s))
            except Exception:  # noqa: BLE001 - the peer may be gone; closing must not fail
                pass
            net.world.close()

    def _require_net(self) -> SyncLinks:
        if self._net is None:
            raise RuntimeError(f"{type(self).__name__} used before init() or after close()")
        return self._net
