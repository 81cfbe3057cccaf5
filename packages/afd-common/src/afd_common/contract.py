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

FFN half: one of two protocols, and the FFN serving loop is chosen by which (``afd_ffn.service``):

* ``ScheduledFFNConnector`` (P2P, CAMP2p: a control plane announces each step), driven by the
  scheduled loop (``afd_ffn.scheduled_loop``)::

      plan = recv_step()                 # blocks until the attention side starts a step
      for each MoE layer, for each stage s:
          item = recv_layer(s, layer)    # exactly the rows the plan announced
          send_ffn_output(experts(item), item)
      end_step()

* ``StreamingFFNConnector`` (CAMAsync: no control plane; the receive is the clock), driven by
  the streaming loop (``afd_ffn.streaming_loop``)::

      while True:
          item = recv_next(stage_idx, max_num_tokens)   # item.layer_idx off the wire
          if item.meta.is_stop: break
          send_ffn_output(experts(item), item)
          end_step()

Lifecycle, both halves: ``init()`` rendezvouses, runs the handshake (``fingerprint()`` of both
sides must agree) and forms the process groups -- the half's ``Net``, which its ``_open`` returns
and ``close()`` releases (idempotent). Every blocking wait is bounded by ``timeouts``; a lost peer
raises ``AFDPeerError`` naming the rank and what was awaited.

A half is its connector's class over one of these three (``AttentionConnector``,
``ScheduledFFNConnector``, ``StreamingFFNConnector``), plus at most a mixin its two halves share:
the world, the control plane and the I/O are values it holds, not base classes.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import torch

from afd_common.config import AFDConfig
from afd_common.errors import AFDProtocolError
from afd_common.metadata import (LayerCall, ModelShape, StepKind, StepMetadata, WorkItem,
                                 WorkItemMeta, new_tuple)
from afd_common.topology import Topology


@dataclass
class Timeouts:
    """The first step may include compilation and weight loading on the peer; later steps not."""

    first_step_s: float
    step_s: float

    def __post_init__(self):
        #: The bound of a wait now. An attribute: it is read on every layer's path.
        self.current_s = self.first_step_s

    def step_done(self) -> None:
        self.current_s = self.step_s

    @classmethod
    def from_config(cls, config: AFDConfig) -> Timeouts:
        return cls(config.extra.first_step_timeout_s, config.extra.step_timeout_s)


class PendingResult(NamedTuple):
    """What ``send_attn_output`` returns and ``recv_ffn_output`` consumes, once: the connector's
    state of one call in flight (buffers, posted receives, where each row went), opaque to the
    caller -- like DeepEP's dispatch handle, which its combine consumes. A tuple: one is made per
    layer on the path from a result to the next send."""

    call: LayerCall
    state: Any = None

    def __repr__(self) -> str:
        return f"PendingResult({self.call})"


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

    def post_next(self) -> None:
        """FFN side, once a step's plan is in hand: get ready for the next step's metadata (a
        transport that needs no posted receive does nothing). Idempotent; ``recv_step`` does it
        if nobody did."""


class Net(Protocol):
    """What a half's ``_open`` returns and ``close`` releases: its world, groups and control
    plane (afd_common.transport.sync_links, afd_common.transport.cam). A half holds it in
    values, never in a module global, so a session may drop one world and open the next."""

    #: The step metadata's carrier; None where the data path carries it (streaming).
    control: ControlPlane | None

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Call ``on_lost(reason)`` from another thread once a peer's connection drops."""

    def goodbye(self, stop: StepMetadata, settle_s: float) -> None:
        """Where a control plane carries the steps: an attention half's last word, the STOP
        step (``AttentionConnector._goodbye``; a streaming connector says it in its data path)."""

    def close(self, settle_s: float = 0.0) -> None:
        """Release everything, after waiting up to ``settle_s`` (best effort) until the peers
        took what this half sent. No loss is reported once closing began."""


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
        self._net: Net | None = None
        #: Set by ``close``: a wait for the peers in ``init`` (another thread) ends at once.
        self.closing = threading.Event()
        size = (config.num_attention_ranks if self.role == "attention"
                else config.num_ffn_ranks)
        if not 0 <= local_rank < size:
            raise ValueError(f"{self.role} rank {local_rank} out of range [0, {size}) "
                             f"(num_{self.role}_ranks = {size})")

    @property
    def control_plane(self) -> ControlPlane | None:
        """None for connectors that carry metadata in the data path (and before ``init``)."""
        return None if self._net is None else self._net.control

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

    def init(self) -> None:
        """Rendezvous, handshake, form process groups (``_open``). Waiting for the peers is
        bounded by ``connect_timeout_s`` only; forming the groups by the first-step timeout."""
        if self._net is None:
            self._net = self._open()

    @abc.abstractmethod
    def _open(self) -> Net:
        """This half's world: rendezvous, handshake and groups."""

    def _require_net(self) -> Net:
        if self._net is None:
            raise RuntimeError(f"{type(self).__name__} used before init() or after close()")
        return self._net

    def close(self) -> None:
        """Release groups and sockets; an ``init`` waiting for the peers in another thread
        raises AFDPeerError at once. Idempotent; safe after a failed ``init``."""
        self.closing.set()
        net, self._net = self._net, None
        if net is not None:
            self._release(net)

    def _release(self, net: Net) -> None:
        """What ``close`` does with the world it took from this half (a goodbye first, where
        the peers expect one). Never raises: the peer may be gone already."""
        net.close()

    def __enter__(self):
        self.init()
        return self

    def __exit__(self, *exc):
        self.close()


class AttentionConnector(AFDConnector):
    """Besides the primitives, the bookkeeping every attention half needs whatever moves its
    rows: the current step, the calls in flight, and the checks that refuse bad input before
    anything is sent (``_check_send``, ``_pending``, ``_take``)."""

    role: ClassVar[str] = "attention"

    #: Set before ``init`` by a lock-step attention rank's session: the forwards it finished so
    #: far, told to the other attention ranks in the handshake (None: nothing to line up).
    steps_done: int | None = None
    #: Set by ``init``: empty steps to run first, so that the FFN side pairs another rank's
    #: re-run of a forward this rank finished with one of them (afd_common.transport.world).
    catch_up_steps: int = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._step: StepMetadata | None = None
        self._inflight: set[LayerCall] = set()  # sent, result not yet received
        # What a send of each stage of the current step must look like: (hidden rows' size,
        # routing's size or None); made by the step's first ``_check_send`` (None until then: a
        # half whose compiled path takes every call never needs it).
        self._expect: tuple[tuple[torch.Size, torch.Size | None], ...] | None = None
        self._moe_set = frozenset(self.shape.moe_layers)

    # -- the primitives ----------------------------------------------------------------------

    def begin_step(self, meta: StepMetadata) -> None:
        """Announce a step (including profile, dummy and warm-up steps) to the FFN side."""
        self._require_net()
        unreceived = self._unreceived()
        if unreceived:
            raise RuntimeError(f"step {meta.step} begins with results of the previous step "
                               f"still unreceived: {unreceived}")
        control = self.control_plane
        if control is not None:
            # The FFN side would refuse the plan (a protocol error that ends the step on both
            # sides); refused here, nothing is sent and the connector stays usable.
            tokens = sum(meta.stage_tokens)
            if tokens > self.shape.max_num_tokens:
                raise ValueError(f"step {meta.step} has {tokens} tokens (stage_tokens "
                                 f"{list(meta.stage_tokens)[:8]}), more than max_num_tokens "
                                 f"{self.shape.max_num_tokens} (--max-num-batched-tokens), "
                                 "which both roles size their messages by")
        # This step's before its plan goes: a failure after that must not leave the last one's.
        self._step, self._expect = meta, None
        if control is not None:
            control.send_step(meta)  # before the rest: the FFN side's first rows wait for it

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
        while no step is running."""
        self._require_net().watch(on_lost)

    # -- for the halves ----------------------------------------------------------------------

    def _unreceived(self) -> list[LayerCall]:
        """The calls sent and not received, sorted (a half that keeps some elsewhere adds
        them)."""
        return sorted(self._inflight)

    def _in_flight(self, call: LayerCall) -> bool:
        """Whether ``call`` is sent and not received (as ``_unreceived``, for one call)."""
        return call in self._inflight

    def _pending(self, call: LayerCall, state) -> PendingResult:
        self._inflight.add(call)
        return new_tuple(PendingResult, (call, state))

    def _take(self, pending: PendingResult):
        """The state of a call in flight, once: a handle received twice, or from before a
        close, is refused."""
        call, state = pending
        if call not in self._inflight or self._net is None:
            self._require_net()
            raise RuntimeError(f"recv_ffn_output({call}): not in flight (received "
                               f"already?); in flight: {self._unreceived()}")
        self._inflight.discard(call)
        return state

    def _check_send(self, hidden, call, topk_ids, topk_weights) -> int:
        """Rows of ``hidden`` after checking it against the model shape and the step; every
        check runs before anything is sent.

        On the path from one layer's result to the next layer's send, where each line costs
        (its code is cold after every wait: up to 1 us a line, measured), so a call is compared
        in one condition with what the step's first call prepared (``_expect``); anything else
        goes through every check one by one, which names what is wrong."""
        layer, stage = call
        expect = self._expect
        if expect is None:
            expect = self._expect = self._expected()
        if (0 <= stage < len(expect) and hidden.dtype == self.shape.dtype
                and layer in self._moe_set and call not in self._inflight
                and self._net is not None):
            size, routing = expect[stage]
            if hidden.shape == size and (
                    topk_ids is None and topk_weights is None if routing is None
                    else topk_ids is not None and topk_weights is not None
                    and topk_ids.shape == routing and topk_weights.shape == routing):
                return size[0]
        return self._check_send_one_by_one(hidden, call, topk_ids, topk_weights)

    def _expected(self) -> tuple[tuple[torch.Size, torch.Size | None], ...]:
        """``_expect`` for the current step (none before the first)."""
        if self._step is None:
            return ()
        h, k = self.shape.hidden_size, self.shape.top_k
        gate = self.config.compute_gate_on_attention
        return tuple((torch.Size((n, h)), torch.Size((n, k)) if gate else None)
                     for n in self._step.stage_tokens)

    def _check_send_one_by_one(self, hidden, call, topk_ids, topk_weights) -> int:
        self._require_net()
        shape, step = self.shape, self._step
        if step is None:
            raise RuntimeError("send_attn_output before begin_step")
        layer, stage = call
        shape.check_layer(layer)
        tokens = step.stage_tokens
        if not 0 <= stage < len(tokens):
            raise ValueError(f"stage {stage} out of range: step {step.step} has "
                             f"{len(tokens)} stages")
        if self._in_flight(call):
            raise RuntimeError(f"{call} sent twice without receiving its result")
        size = hidden.shape
        if len(size) != 2 or size[1] != shape.hidden_size:
            raise ValueError(f"hidden states of shape {tuple(size)}: expected "
                             f"[tokens, {shape.hidden_size}] (hidden_size)")
        if hidden.dtype != shape.dtype:
            raise ValueError(f"hidden states of dtype {hidden.dtype}: this AFD world moves "
                             f"{shape.dtype}")
        rows = size[0]
        if rows != tokens[stage]:
            raise ValueError(f"layer {layer} stage {stage}: {rows} rows, but step "
                             f"{step.step} announced {tokens[stage]}")
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

    def _release(self, net: Net) -> None:
        try:
            if not self._unreceived():  # the FFN side's loop then ends cleanly, not by a timeout
                self._goodbye(net)
        except Exception:  # noqa: BLE001 - the peer may already be gone; closing must not fail
            pass
        finally:
            self._inflight.clear()
            net.close()

    def _goodbye(self, net: Net) -> None:
        """Tell the FFN side this rank stops: a STOP step on the control plane."""
        step = self._step.step + 1 if self._step else 0
        net.goodbye(StepMetadata(step, StepKind.STOP, (0,) * self.config.extra.num_micro_batches),
                    min(5.0, self.timeouts.step_s))


class ScheduledFFNConnector(AFDConnector):
    """The step's token counts first (the control plane), then every layer and stage in order,
    each receive sized by them (the P2P connector's compiled link posts a step's first ahead, by
    the bound they are held to). Besides the primitives, the step's bookkeeping that
    sizes those receives, checked against this role's own limits (``_stage_sources``,
    ``work_item``, ``_check_output``)."""

    role: ClassVar[str] = "ffn"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._links = self.topology.links_of_ffn(self.local_rank)
        self._plan: StepPlan | None = None
        self._sources: list[tuple[tuple[int, int], ...]] = []

    # -- the primitives ----------------------------------------------------------------------

    def recv_step(self) -> StepPlan:
        """The next step's plan: every served attention rank's ``StepMetadata``. Waits as long
        as the peers are connected (an idle role may wait for days)."""
        return self._begin_plan(self._require_net().control.recv_step(None))

    @abc.abstractmethod
    def recv_layer(self, stage_idx: int, layer_idx: int,
                   max_num_tokens: int | None = None) -> WorkItem:
        """The rows of ``layer_idx`` and ``stage_idx`` the plan announced. Asked for in order
        (MoE layers ascending, each layer's stages ascending), so a half may post its receives
        ahead. The item's tensors may be the half's receive buffers: they hold this item's rows
        until the result of the same stage's next layer is sent (a runner that keeps them longer
        copies them). Bounded wait."""

    @abc.abstractmethod
    def send_ffn_output(self, output: torch.Tensor, item: WorkItem) -> None:
        """Return ``item``'s result rows to their sources. Never blocks on the peer."""

    def end_step(self) -> None:
        """The step is served: later waits use the step timeout."""
        self.timeouts.step_done()

    # -- for the halves ----------------------------------------------------------------------

    def _begin_plan(self, plan: StepPlan) -> StepPlan:
        """A plan received: checked and remembered, and unless it is a STOP the step begun."""
        self._on_step(plan)
        if plan.kind != StepKind.STOP:
            self._post_first()
        return plan

    def _post_first(self) -> None:
        """Right after a plan: the step's first receives, for a half that posts them ahead,
        and the next step's metadata's (here, or where it costs the step's first layer less;
        the attention side's goodbye waits, bounded, until it is posted)."""
        self._net.control.post_next()

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
        # Made link by link and turned per stage (every source announced as many stages).
        chunk_rows = self.topology.chunk_rows
        self._sources = list(zip(*[
            [(link.attention_rank, chunk_rows(link, n))
             for n in plan.per_source[link.attention_rank].stage_tokens]
            for link in self._links]))

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
        self._require_net()
        want = (rows, self.shape.hidden_size)
        if output.shape != want or output.dtype != self.shape.dtype:
            raise ValueError(f"FFN output of shape {tuple(output.shape)} {output.dtype}: "
                             f"expected {want} {self.shape.dtype}")

    def _release(self, net: Net) -> None:
        net.close(settle_s=min(5.0, self.timeouts.step_s))


class StreamingFFNConnector(AFDConnector):
    """No schedule: whatever work item of any layer arrives next."""

    role: ClassVar[str] = "ffn"

    @abc.abstractmethod
    def recv_next(self, stage_idx: int = 0, max_num_tokens: int | None = None) -> WorkItem:
        """The next work item; its layer and stage come off the wire (``item.meta``). A stop
        item (``item.meta.is_stop``) says every attention rank stopped. Bounded wait."""

    @abc.abstractmethod
    def send_ffn_output(self, output: torch.Tensor, item: WorkItem) -> None:
        """Return ``item``'s result rows to its source. Never blocks on the peer."""

    def end_step(self) -> None:
        """A work item is served: later waits use the step timeout."""
        self.timeouts.step_done()


#: Either FFN protocol: what the FFN serving loops and the service take.
FFNConnector = ScheduledFFNConnector | StreamingFFNConnector
