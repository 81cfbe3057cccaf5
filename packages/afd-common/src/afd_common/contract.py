"""The connector contract: what every AFD transport provides, readable in one file.

A connector has two halves, one per role, each in its role's package and registered under the
same name (``afd_common.registry``). Who calls what:

Attention half (``AttentionConnector``), called by the attention model wrapper, per step::

    begin_step(StepMetadata)            # once per step: control plane, if the connector has one
    for each MoE layer, for each micro-batch stage s:
        pending = send_attn_output(hidden, LayerCall(layer, s), topk_ids, topk_weights)
        ... compute attention of stage s+1 ...                 # the send never blocks
        recv_ffn_output(pending) -> Tensor                     # waits, bounded
    end_step()

FFN half: one of two protocols, and the FFN runner is chosen by which (``afd_ffn.service``):

* ``ScheduledFFNConnector`` (P2P, CAMP2p: a control plane announces each step), driven by the
  sync runner::

      plan = recv_step()                 # blocks until the attention side starts a step
      for each MoE layer, for each stage s:
          item = recv_layer(s, layer)    # exactly the rows the plan announced
          send_ffn_output(experts(item), item)
      end_step()

* ``StreamingFFNConnector`` (CAMAsync: no control plane; the receive is the clock), driven by
  the async runner::

      while True:
          item = recv_next(stage_idx, max_num_tokens)   # item.layer_idx off the wire
          if item.meta.is_stop: break
          send_ffn_output(experts(item), item)
          end_step()

Lifecycle: ``init()`` rendezvouses, runs the handshake (``fingerprint()`` of both sides must
agree) and forms the process groups; ``close()`` releases them and is idempotent. Every blocking
wait is bounded by ``timeouts``; a lost peer raises ``AFDPeerError`` naming the rank and what was
awaited.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from afd_common.config import AFDConfig
from afd_common.metadata import LayerCall, ModelShape, StepMetadata, WorkItem
from afd_common.topology import Topology


@dataclass
class Timeouts:
    """The first step may include compilation and weight loading on the peer; later steps not."""

    first_step_s: float
    step_s: float
    _first_done: bool = False

    def current(self) -> float:
        return self.step_s if self._first_done else self.first_step_s

    def step_done(self) -> None:
        self._first_done = True

    @classmethod
    def from_config(cls, config: AFDConfig) -> Timeouts:
        return cls(config.extra.first_step_timeout_s, config.extra.step_timeout_s)


@dataclass(frozen=True)
class PendingResult:
    """What ``send_attn_output`` returns and ``recv_ffn_output`` consumes, once: the connector's
    state of one call in flight (buffers, posted receives, where each row went), opaque to the
    caller -- like DeepEP's dispatch handle, which its combine consumes."""

    call: LayerCall
    state: Any = field(default=None, repr=False)


@dataclass(frozen=True)
class StepPlan:
    """The FFN side's view of one step: each served attention rank's ``StepMetadata``."""

    step: int
    per_source: dict[int, StepMetadata]

    @property
    def kind(self):
        return next(iter(self.per_source.values())).kind

    @property
    def num_stages(self) -> int:
        return next(iter(self.per_source.values())).num_stages


class ControlPlane(abc.ABC):
    """Carries ``StepMetadata`` once per step from the attention ranks to their FFN peers."""

    @abc.abstractmethod
    def send_step(self, meta: StepMetadata) -> None:
        """Attention side. Does not wait for the FFN side to be ready for the step."""

    @abc.abstractmethod
    def recv_step(self, timeout_s: float | None) -> StepPlan:
        """FFN side. Blocks until every served attention rank announced the step; ``None``
        waits as long as the peers are connected (an idle role may wait for days)."""


class AFDConnector(abc.ABC):
    """Lifecycle and identity shared by both halves."""

    #: "attention" or "ffn": which half this class is.
    role: ClassVar[str]
    #: True for connectors whose FFN half streams (``StreamingFFNConnector``): no control plane.
    supports_async_dp: ClassVar[bool] = False
    #: True when the connector needs top-k routing from the attention side.
    requires_gate_on_attention: ClassVar[bool] = False
    #: The wire protocol both halves speak; aliases of one connector share it.
    protocol: ClassVar[str]
    #: Keys of ``connector_extra_config`` this connector reads beyond the common ones.
    extra_config_keys: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: AFDConfig, local_rank: int, shape: ModelShape,
                 device: torch.device | str = "cpu"):
        if config.role != self.role:
            raise ValueError(f"{type(self).__name__} is the {self.role} half, "
                             f"config role is {config.role!r}")
        self.config = config
        self.local_rank = local_rank
        self.shape = shape
        self.device = torch.device(device)
        self.topology = Topology(config.num_attention_ranks, config.num_ffn_ranks,
                                 sharded=shape.placement.sharded)
        self.timeouts = Timeouts.from_config(config)
        #: Set by ``close``: a wait for the peers in ``init`` (another thread) ends at once.
        self.closing = threading.Event()
        size = (config.num_attention_ranks if self.role == "attention"
                else config.num_ffn_ranks)
        if not 0 <= local_rank < size:
            raise ValueError(f"{self.role} rank {local_rank} out of range [0, {size}) "
                             f"(num_{self.role}_ranks = {size})")

    @property
    @abc.abstractmethod
    def control_plane(self) -> ControlPlane | None:
        """None for connectors that carry metadata in the data path."""

    def fingerprint(self) -> dict[str, Any]:
        """What both roles must agree on before any tensor moves. Compared field by field."""
        s, c = self.shape, self.config
        return {
            "connector": self.protocol,
            "num_attention_ranks": c.num_attention_ranks,
            "num_ffn_ranks": c.num_ffn_ranks,
            "compute_gate_on_attention": c.compute_gate_on_attention,
            "async_dp": c.async_dp,
            "num_micro_batches": c.extra.num_micro_batches,
            "architecture": s.architecture,
            "num_layers": s.num_layers,
            "moe_layers": list(s.moe_layers),
            "hidden_size": s.hidden_size,
            "num_experts": s.num_experts,
            "top_k": s.top_k,
            "dtype": str(s.dtype).removeprefix("torch."),
            "max_num_tokens": s.max_num_tokens,
            **s.placement.fingerprint(),
        }

    @abc.abstractmethod
    def init(self) -> None:
        """Rendezvous, handshake, form process groups. Bounded by the first-step timeout."""

    def close(self) -> None:
        """Release groups and sockets; an ``init`` waiting for the peers in another thread
        raises AFDPeerError at once. Idempotent; safe after a failed ``init``."""
        self.closing.set()
        self._release()

    @abc.abstractmethod
    def _release(self) -> None:
        """What ``close`` releases (the groups, after a goodbye to the peers if one is due)."""

    def __enter__(self):
        self.init()
        return self

    def __exit__(self, *exc):
        self.close()


class AttentionConnector(AFDConnector):
    role: ClassVar[str] = "attention"

    #: Set before ``init`` by a lock-step attention rank's session: the forwards it finished so
    #: far, told to the other attention ranks in the handshake (None: nothing to line up).
    steps_done: int | None = None
    #: Set by ``init``: empty steps to run first, so that the FFN side pairs another rank's
    #: re-run of a forward this rank finished with one of them (afd_common.world).
    catch_up_steps: int = 0

    def begin_step(self, meta: StepMetadata) -> None:
        """Announce a step (including profile, dummy and warm-up steps) to the FFN side."""
        if self.control_plane is not None:
            self.control_plane.send_step(meta)

    @abc.abstractmethod
    def send_attn_output(self, hidden_states: torch.Tensor, call: LayerCall,
                         topk_ids: torch.Tensor | None = None,
                         topk_weights: torch.Tensor | None = None) -> PendingResult:
        """Hand one layer's and stage's rows to the FFN side: ``hidden_states`` [tokens, H] in
        the model dtype; with the gate on the attention role ``topk_ids`` [tokens, top_k] (int)
        and ``topk_weights`` [tokens, top_k] (float), else None. Never blocks on the peer."""

    @abc.abstractmethod
    def recv_ffn_output(self, pending: PendingResult) -> torch.Tensor:
        """The routed experts' output for the rows ``pending`` sent: [tokens, H], the dtype
        sent. Bounded wait."""

    def end_step(self) -> None:
        """The step finished on this side: later waits use the step timeout."""
        self.timeouts.step_done()

    def watch_peers(self, on_lost: Callable[[str], None]) -> None:
        """Call ``on_lost(reason)`` (from another thread) as soon as an FFN peer is gone, also
        while no step is running. Connectors that cannot tell leave this a no-op."""


class FFNConnector(AFDConnector):
    """What both FFN protocols share: the result goes back, and a served unit ends."""

    role: ClassVar[str] = "ffn"

    @abc.abstractmethod
    def send_ffn_output(self, output: torch.Tensor, item: WorkItem) -> None:
        """Return ``item``'s result rows to their sources. Never blocks on the peer."""

    def end_step(self) -> None:
        """A step (scheduled) or a work item (streaming) is served: later waits use the step
        timeout."""
        self.timeouts.step_done()


class ScheduledFFNConnector(FFNConnector):
    """The step's token counts first, then every layer and stage in order, each receive posted
    with its exact size."""

    @abc.abstractmethod
    def recv_step(self) -> StepPlan:
        """The next step's plan: every served attention rank's ``StepMetadata``. Waits as long
        as the peers are connected (an idle role may wait for days)."""

    @abc.abstractmethod
    def recv_layer(self, stage_idx: int, layer_idx: int,
                   max_num_tokens: int | None = None) -> WorkItem:
        """The rows of ``layer_idx`` and ``stage_idx`` the plan announced. Bounded wait."""


class StreamingFFNConnector(FFNConnector):
    """No schedule: whatever work item of any layer arrives next."""

    @abc.abstractmethod
    def recv_next(self, stage_idx: int = 0, max_num_tokens: int | None = None) -> WorkItem:
        """The next work item; its layer and stage come off the wire (``item.meta``). A stop
        item (``item.meta.is_stop``) says every attention rank stopped. Bounded wait."""


def deadline(timeout_s: float) -> float:
    return time.monotonic() + timeout_s
