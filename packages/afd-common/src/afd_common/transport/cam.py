"""What the halves of the CAM connectors share: the ``afd_ascend`` ops, their named groups, and
the two worlds.

The hidden states of ``CAMP2pAFDConnector`` move through ``afd_ascend.a2e`` / ``e2a`` (semantics:
``afd-ascend-ops/csrc/cam_p2p.cpp``). The ops find their process group by name, so each
micro-batch stage gets a group of its own, registered with c10d under a name unique to this
process. Step metadata rides the same Gloo control plane as the P2P connector.

CAMP2p world, FFN first (the layout the ops expect)::

    global rank:  0 .. F-1      F .. F+A-1
                  FFN f         attention a  (global = F + a)

Replicated experts: attention rank ``a`` talks to FFN rank ``a % F``, which serves ``f, f+F, ...``
as one batch in that order (the P2P mapping for ``A >= F``). ``A < F`` is refused: ``a2e`` never
splits one attention rank's rows over several FFN ranks. Sharded experts: both ops get the
placement's owner table (``expert_owner``) and go M2N -- each row to the FFN ranks that own one of
its top-k experts, any A:F.

CAMAsync world, attention first (the P2P layout), with the experts sharded over the FFN ("MoE")
ranks as ``afd_common.placement`` places them (vLLM's linear EP placement, which the FFN role
gets with ``--enable-expert-parallel``): global expert ``e`` lives on FFN rank ``e // R``
(``R = num_experts / F``, the same share on every rank, as the ops' headers require) as its local
expert ``e % R``. There is no control plane: ``afd_async_dispatch_send`` carries the layer index
and row counts in its header, ``afd_async_dispatch_recv`` returns whichever attention DP group is
ready, so idle attention ranks never hold the FFN side back. Each micro-batch stage is a
``comm_id`` of one registered group.
"""

from __future__ import annotations

import importlib
from typing import ClassVar

import torch

from afd_common.transport import inorder
from afd_common.transport.control_plane import GlooControlPlane, link_peers
from afd_common.errors import AFDConfigError, AFDPeerError, AFDTimeoutError
from afd_common.transport.sync_links import WATCH_TAG, SyncLinks
from afd_common.transport.peer_io import PeerIO, first_line, is_timeout
from afd_common.transport.process_groups import (default_backend, register_named_group,
                                                 unregister_group)
from afd_common.transport.world import open_world

CAM_P2P_PROTOCOL = "camp2p/1"
CAM_ASYNC_PROTOCOL = "camasync/1"
# Attention ranks per CAMAsync DP group: the attention role runs TP 1 per DP rank.
ATTENTION_TP = 1


def require_ops(kind: str, device: torch.device, connector: str, role: str) -> None:
    """Load the ``afd_ascend`` library and check it has ``kind``'s ops for ``device``
    ("p2p" or "async"). Raises before any socket or group exists."""
    try:
        ops = importlib.import_module("afd_ascend_ops")
    except ImportError:
        raise RuntimeError(f"{connector} needs the afd_ascend op library: install "
                           f"'afd-{role}[ascend]' (package afd-ascend-ops)") from None
    check = (ops.ensure_cam_p2p_ops_available if kind == "p2p"
             else ops.ensure_cam_async_ops_available)
    check(device)


_portable_release: bool | None = None


def _portable() -> bool:
    global _portable_release
    if _portable_release is None:
        _portable_release = torch._C._dispatch_has_kernel("afd_portable::release_sends")
    return _portable_release


def forget_group(group_name: str) -> None:
    """After the group's world closed: drop what the portable kernels keep for it (pending
    sends, CAMAsync's posted receives), which would keep the closed world's store -- and its
    port -- alive. A no-op for a vendor's library."""
    if _portable():
        torch.ops.afd_portable.forget_group(group_name)


def release_sends(group_name: str, peer: int = -1) -> None:
    """Free the tensors of this group's sends to ``peer`` (every peer if -1), called where the
    protocol proves the peer has them. The portable kernels keep each sent tensor until then: a
    Gloo send completes only once the peer posted its receive and says so only when waited on,
    so nothing else would free it. A vendor's afd_ascend library manages its own buffers and has
    no such op; then this does nothing."""
    if _portable():
        torch.ops.afd_portable.release_sends(group_name, peer)


def check_cam_p2p_topology(num_attention_ranks: int, num_ffn_ranks: int, sharded: bool) -> None:
    if num_attention_ranks < num_ffn_ranks and not sharded:
        raise AFDConfigError("num_ffn_ranks", num_ffn_ranks,
                             f"CAMP2pAFDConnector needs num_attention_ranks "
                             f"({num_attention_ranks}) >= num_ffn_ranks: afd_ascend.a2e sends "
                             "each attention rank's rows to one FFN rank (a % F) unless the "
                             "experts are sharded (--enable-expert-parallel)")


def cam_p2p_global_rank(num_ffn_ranks: int):
    def global_rank(role: str, local_rank: int) -> int:
        return local_rank if role == "ffn" else num_ffn_ranks + local_rank
    return global_rank


def open_cam_p2p_world(connector) -> tuple[SyncLinks, list[str]]:
    """Rendezvous, handshake, the control plane and one registered data group per stage.
    Returns the links and the group names to pass to the ops, by stage."""
    cfg, topo = connector.config, connector.topology
    global_rank = cam_p2p_global_rank(topo.num_ffn_ranks)
    backend = cfg.extra.backend or default_backend(connector.device)
    world = open_world(connector, global_rank)
    links = SyncLinks(world, None)  # type: ignore[arg-type] - control set below
    try:
        ctrl_io = PeerIO(world.group("control", "gloo"), world.describe)
        links.control = GlooControlPlane(
            ctrl_io, link_peers(topo, cfg.role, connector.local_rank, global_rank), cfg.role,
            connector.timeouts.step_s)
        names = []
        for stage in range(cfg.extra.num_micro_batches):
            name = f"afd-camp2p-{cfg.port}-{cfg.role}{connector.local_rank}-stage{stage}"
            pg = register_named_group(world.group(f"data{stage}", backend),
                                      world.rendezvous.store, world.rank, world.world_size, name,
                                      connector.device)
            # c10d's registry holds groups weakly: the closure keeps ours alive until close.
            links.on_close.append(lambda name=name, pg=pg: (unregister_group(name),
                                                            forget_group(name)))
            names.append(name)
    except BaseException:
        links.close()
        raise
    return links, names


# How a transport failure reads (the ops' own waits, Gloo's connection errors), as opposed to an
# op refusing its input, which is passed on unchanged.
_TRANSPORT_WORDS = ("waiting for", "onnection", "Broken pipe", "closed", "Socket")


def op_error(e: RuntimeError, what: str, peer: str) -> Exception:
    """An op's failure as the connector's error type, naming the peer: a timeout or a lost peer;
    any other failure (bad input, named by the op) as it is."""
    if is_timeout(e):
        return AFDTimeoutError(f"no {what} from {peer} in time: {first_line(e)}")
    if any(word in str(e) for word in _TRANSPORT_WORDS):
        return AFDPeerError(f"{what}: lost {peer}: {first_line(e)}")
    return e


def check_cam_async(config, shape) -> int:
    """``R``, each FFN rank's share of the routed experts, after checking what CAMAsync needs:
    one share size for every rank, placed as the ops address them (rank ``e // R``)."""
    num_experts, placement = shape.num_experts, shape.placement
    if config.extra.num_micro_batches != 1:
        raise AFDConfigError("connector_extra_config.num_micro_batches",
                             config.extra.num_micro_batches,
                             "CAMAsyncAFDConnector pipelines by construction (the FFN side "
                             "serves whichever attention rank is ready); use 1")
    F = config.num_ffn_ranks
    if num_experts <= 0 or num_experts % F:
        raise AFDConfigError("num_ffn_ranks", F,
                             f"CAMAsyncAFDConnector shards the {num_experts} routed experts over "
                             "the FFN ranks: num_ffn_ranks must divide the expert count")
    R = num_experts // F
    if F > 1 and not placement.sharded:
        raise AFDConfigError("enable_expert_parallel", False,
                             "CAMAsyncAFDConnector sends each row only to the FFN rank that "
                             "owns its expert: start both roles with --enable-expert-parallel so "
                             "that each FFN rank loads only its share")
    if F > 1 and placement.owners != tuple(e // R for e in range(num_experts)):
        raise AFDConfigError("expert_placement_strategy", placement.strategy,
                             "CAMAsyncAFDConnector addresses expert e on FFN rank e // R: use "
                             "the linear placement (--expert-placement-strategy linear)")
    return R


class OpsLinks:
    """One registered data group for the ``afd_ascend`` ops (CAMAsync), plus Gloo I/O on the
    same backend for watching peers (afd_common.contract.Net)."""

    control = None  # the ops' headers carry the routing metadata

    def __init__(self, connector):
        cfg = connector.config
        backend = cfg.extra.backend or default_backend(connector.device)
        self.world = open_world(connector)
        # An attention rank watches every FFN rank (its rows may go to any); an FFN rank no one.
        self._peers = ([connector.topology.ffn_global_rank(f) for f in range(cfg.num_ffn_ranks)]
                       if connector.role == "attention" else [])
        self.name = f"afd-camasync-{cfg.port}-{cfg.role}{connector.local_rank}"
        try:
            group = self.world.group("data", backend)
            # Held: c10d's registry holds groups weakly.
            self._pg = register_named_group(group, self.world.rendezvous.store, self.world.rank,
                                            self.world.world_size, self.name, connector.device)
            self.io = PeerIO(group if backend == "gloo" else self.world.group("watch", "gloo"),
                             self.world.describe)
        except BaseException:
            self.close()
            raise

    def watch(self, on_lost) -> None:
        self.io.watch(self._peers, WATCH_TAG, lambda peer, reason: on_lost(reason))

    def close(self, settle_s: float = 0.0) -> None:
        """``settle_s`` unused: the ops settle their own sends (``release_sends``)."""
        io = getattr(self, "io", None)
        if io is not None:
            io.closing = True
        unregister_group(self.name)
        self._pg = None
        self.world.close()
        forget_group(self.name)


class CAMP2pHalf:
    """What both halves of ``CAMP2pAFDConnector`` share (mixed in before the sync base)."""

    protocol: ClassVar[str] = CAM_P2P_PROTOCOL

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_cam_p2p_topology(self.config.num_attention_ranks, self.config.num_ffn_ranks,
                               self.topology.sharded)
        self._groups: list[str] = []
        self._owner = (self.shape.placement.owner_table.to(self.device)
                       if self.topology.sharded else None)

    def _open(self) -> SyncLinks:
        require_ops("p2p", self.device, "CAMP2pAFDConnector", self.role)
        inorder.enabled()  # the ops read AFD_TEST_INORDER themselves; this logs that it is on
        links, self._groups = open_cam_p2p_world(self)
        return links

    def _release_sends(self) -> None:
        """At a step boundary, where every send of the last step was received: the attention
        side begins a step after receiving all of the last one's results, which the FFN side
        sent after receiving all of its rows; the FFN side is told of a step only by attention
        ranks that finished the last one, every result received. A peer lost since then fails
        the wait as any other op does (the attention side rides through it)."""
        try:
            for name in self._groups:
                release_sends(name)
        except RuntimeError as e:
            raise op_error(e, "the last step's sends", self._peer) from None

    def _op_args(self, stage: int) -> dict:
        """The arguments of a2e / e2a every call of this half passes."""
        c, shape = self.config, self.shape
        rank = cam_p2p_global_rank(c.num_ffn_ranks)(self.role, self.local_rank)
        return dict(hidden_size=shape.hidden_size,
                    topk=shape.top_k if c.compute_gate_on_attention else 0,
                    expert_rank_size=c.num_ffn_ranks, attention_rank_size=c.num_attention_ranks,
                    rank=rank, group_ep=self._groups[stage], expert_owner=self._owner)


class CAMAsyncHalf:
    """What both halves of ``CAMAsyncAFDConnector`` share (mixed in before the contract class)."""

    protocol: ClassVar[str] = CAM_ASYNC_PROTOCOL
    supports_async_dp: ClassVar[bool] = True
    requires_gate_on_attention: ClassVar[bool] = True
    extra_config_keys: ClassVar[frozenset[str]] = frozenset({"dynamic_quant"})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        c = self.config
        self._R = check_cam_async(c, self.shape)
        self._quant = int(bool(c.extra.other.get("dynamic_quant", False)))
        self._comm_args = torch.empty(0, dtype=torch.uint8, device=self.device)

    def _open(self) -> OpsLinks:
        require_ops("async", self.device, "CAMAsyncAFDConnector", self.role)
        inorder.enabled()  # the ops read AFD_TEST_INORDER themselves; this logs it
        return OpsLinks(self)

    def _op_args(self, net: OpsLinks | None = None) -> dict:
        """The arguments every afd_async_* call of this half passes (``net``: the world being
        closed, else this half's)."""
        c, s = self.config, self.shape
        return dict(hidden_size=s.hidden_size, top_k=s.top_k, moe_rank_num=c.num_ffn_ranks,
                    attn_rank_num=c.num_attention_ranks, route_expert_num_per_moe=self._R,
                    world_size=c.num_attention_ranks + c.num_ffn_ranks,
                    group_name=(net or self._require_net()).name)
