"""What the halves of every sync connector (P2P, CAMP2p) share: step bookkeeping, input checks,
the control plane, and an orderly close. The data path is each connector's own.

A sync connector's FFN side learns each step's token counts from the control plane before any
hidden state moves, so every receive is posted with its exact size.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from afd_common.attention_half import AttentionHalf
from afd_common.contract import ControlPlane, ScheduledFFNConnector, StepPlan
from afd_common.control_plane import GlooControlPlane
from afd_common.errors import AFDProtocolError
from afd_common.metadata import StepKind, StepMetadata, WorkItem, WorkItemMeta
from afd_common.transport import PeerIO
from afd_common.world import AFDWorld


@dataclass
class SyncLinks:
    """The world and control plane of one half; ``data`` is the P2P connector's data I/O (None
    for connectors whose data moves through compiled ops), ``on_close`` undoes registrations."""

    world: AFDWorld
    control: GlooControlPlane
    data: PeerIO | None = None
    on_close: list = field(default_factory=list)

    def close(self) -> None:
        self.world.close()  # first: no operation of the groups is in flight after it
        for undo in self.on_close:
            undo()


class _SyncHalf(abc.ABC):
    _net: SyncLinks | None = None

    @property
    def control_plane(self) -> ControlPlane | None:
        return self._net.control if self._net else None

    def init(self) -> None:
        if self._net is None:
            self._net = self._open()

    @abc.abstractmethod
    def _open(self) -> SyncLinks:
        """Rendezvous, handshake and groups."""

    def _require_net(self) -> SyncLinks:
        if self._net is None:
            raise RuntimeError(f"{type(self).__name__} used before init() or after close()")
        return self._net


class SyncAttentionConnector(_SyncHalf, AttentionHalf):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._links = self.topology.links_of_attention(self.local_rank)

    def watch_peers(self, on_lost) -> None:
        net = self._require_net()
        net.control.io.watch(list(net.control.peers), WATCH_TAG,
                             lambda peer, reason: on_lost(reason))

    def begin_step(self, meta: StepMetadata) -> None:
        self._require_net()
        super().begin_step(meta)

    def _take(self, pending):
        self._require_net()
        return super()._take(pending)

    def _release(self) -> None:
        net, self._net = self._net, None
        if net is None:
            return
        if net.data is not None:
            net.data.closing = True
        net.control.io.closing = True
        try:
            if not self._inflight:
                # Tell the FFN side we are done so its runner ends cleanly instead of timing out.
                step = self._step.step + 1 if self._step else 0
                net.control.send_step(StepMetadata(step, StepKind.STOP,
                                                   (0,) * self.config.extra.num_micro_batches))
                net.control.io.flush(min(5.0, self.timeouts.step_s))
        except Exception:  # noqa: BLE001 - the peer may already be gone; closing must not fail
            pass
        finally:
            self._inflight.clear()
            net.close()


class SyncFFNConnector(_SyncHalf, ScheduledFFNConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._links = self.topology.links_of_ffn(self.local_rank)
        self._plan: StepPlan | None = None
        self._sources: list[tuple[tuple[int, int], ...]] = []

    def recv_step(self) -> StepPlan:
        plan = self._require_net().control.recv_step(None)
        self._on_step(plan)
        return plan

    def _on_step(self, plan: StepPlan) -> None:
        """Remember the plan: it sizes every receive of the step."""
        # A peer's counts are checked against this role's own limit before anything is sized by
        # them (both roles run the same --max-num-batched-tokens; the handshake compares it).
        for a, meta in plan.per_source.items():
            if sum(meta.stage_tokens) > self.shape.max_num_tokens:
                raise AFDProtocolError(
                    f"attention rank {a} announced {sum(meta.stage_tokens)} tokens for step "
                    f"{meta.step} (stage_tokens {list(meta.stage_tokens)[:8]}), more than "
                    f"max_num_tokens {self.shape.max_num_tokens}")
        self._plan = plan
        # (attention rank, rows) per stage, in batch order: the same for every layer of the step.
        self._sources = [tuple((link.attention_rank, self.topology.chunk_rows(
            link, plan.per_source[link.attention_rank].stage_tokens[stage]))
            for link in self._links) for stage in range(plan.num_stages)]

    def _stage_sources(self, stage_idx: int, max_num_tokens: int | None,
                       layer_idx: int) -> tuple[tuple[int, int], ...]:
        """This stage's (attention rank, rows), after checking the runner's call."""
        self._require_net()
        plan = self._plan
        if plan is None:
            raise RuntimeError("recv_layer before recv_step")
        self.shape.check_layer(layer_idx)
        if not 0 <= stage_idx < plan.num_stages:
            raise ValueError(f"stage {stage_idx} out of range: step {plan.step} has "
                             f"{plan.num_stages} stages")
        sources = self._sources[stage_idx]
        total = sum(n for _, n in sources)
        if max_num_tokens is not None and total > max_num_tokens:
            raise ValueError(f"step {plan.step} stage {stage_idx} brings {total} rows, more "
                             f"than max_num_tokens {max_num_tokens}")
        return sources

    def work_item(self, hidden: torch.Tensor, meta: WorkItemMeta, ids: torch.Tensor | None,
                  weights: torch.Tensor | None, handle: object | None = None) -> WorkItem:
        """The received rows as a work item, once the top-k expert ids that came with them (gate
        on the attention role) are known to name experts of this model: the MoE kernels index
        the expert weights with them, unchecked. One host sync per item that carries ids."""
        if ids is not None and ids.numel():
            lo, hi = (int(v) for v in torch.aminmax(ids))
            if lo < 0 or hi >= self.shape.num_experts:
                raise AFDProtocolError(
                    f"attention rank{'s' if len(meta.sources) > 1 else ''} "
                    f"{', '.join(str(a) for a, _ in meta.sources)}: layer {meta.layer_idx} stage "
                    f"{meta.stage} routes to expert id {lo if lo < 0 else hi}, outside [0, "
                    f"{self.shape.num_experts}) (topk_ids)")
        return WorkItem(hidden, meta, ids, weights, handle=handle)

    def _check_output(self, output: torch.Tensor, rows: int) -> None:
        want = (rows, self.shape.hidden_size)
        if tuple(output.shape) != want or output.dtype != self.shape.dtype:
            raise ValueError(f"FFN output of shape {tuple(output.shape)} {output.dtype}: "
                             f"expected {want} {self.shape.dtype}")

    def _release(self) -> None:
        net, self._net = self._net, None
        if net is None:
            return
        try:
            io = net.data or net.control.io
            io.flush(min(5.0, self.timeouts.step_s))
        except Exception:  # noqa: BLE001 - the peer may be gone; closing must not fail
            pass
        net.close()


WATCH_TAG = 0x7FFE  # never sent: a receive on it only ends when the connection does
