"""What the two halves of the P2P connector agree on: world layout, message layout, tags.

One message per direction per (layer, stage, link). Attention -> FFN carries the hidden rows and,
when the gate runs on attention, the routing in the same message::

    gate on FFN:        hidden [rows, H] (model dtype), sent as is (no copy)
    gate on attention:  uint8 [ topk_ids int32 [rows, k] | topk_weights f32 [rows, k] | hidden ]

Routing goes first so every part starts 4-byte aligned and is viewed in place on receipt. FFN ->
attention carries the result rows [rows, H] in the model dtype. The Gloo tag encodes
(layer, stage): a desynchronised peer times out with a message naming both, instead of feeding
one layer's rows to another.

With sharded experts how many of an attention rank's rows reach an FFN rank depends on the
layer's routing, and a receive must be posted with its size (NCCL, HCCL): a row count (int64
[1], ``count_tag``) precedes the rows on every attention -> FFN link, also when it is 0. The FFN
side checks it against the step's announced tokens before allocating anything.

The order of operations on one link (one attention rank, one FFN rank), per (layer, stage), the
same on every backend and safe where point-to-point operations match in posting order, tags
ignored (NCCL, HCCL)::

    attention:  send [count]  send rows (if any)  recv result (if any rows)
    FFN:        recv [count]  recv rows (if any)  send result (if any rows)

Neither side posts a receive before the sends that its peer's matching receive follows. Within
that order each receive is posted as early as it can be (the FFN side's next one right after its
send, the attention side's reply right after its send): Gloo holds back a send whose receive is
not posted yet for a notification round trip.
"""

from __future__ import annotations

import torch

from afd_common.transport import inorder
from afd_common.transport.control_plane import GlooControlPlane, link_peers
from afd_common.metadata import MAX_STAGES
from afd_common.transport.sync_links import SyncLinks
from afd_common.transport.peer_io import PeerIO
from afd_common.transport.process_groups import default_backend
from afd_common.transport.world import open_world


PROTOCOL = "p2p/1"


def data_tag(layer_idx: int, stage: int) -> int:
    return layer_idx * MAX_STAGES + stage


class DataTags(dict):
    """(layer, stage) -> ``data_tag``, each computed once: looked up on the path of every
    layer's round trip, where a dict lookup costs less than a call."""

    def __missing__(self, key: tuple[int, int]) -> int:
        tag = self[key] = data_tag(*key)
        return tag


COUNT_TAG_BASE = 1 << 20


def count_tag(layer_idx: int, stage: int) -> int:
    return COUNT_TAG_BASE + data_tag(layer_idx, stage)


def routing_nbytes(rows: int, top_k: int) -> int:
    return rows * top_k * 8


def pack(hidden: torch.Tensor, topk_ids: torch.Tensor | None,
         topk_weights: torch.Tensor | None) -> torch.Tensor:
    if topk_ids is None:
        return hidden if hidden.is_contiguous() else hidden.contiguous()
    parts = [topk_ids.to(torch.int32).contiguous().view(torch.uint8).flatten(),
             topk_weights.to(torch.float32).contiguous().view(torch.uint8).flatten(),
             hidden.contiguous().view(torch.uint8).flatten()]
    return torch.cat(parts)


class ReceiveBuffers:
    """The FFN half's receive buffers, reused: two per (stage, attention rank, what), taken in
    turn, so the rows of a layer land where those of two layers back did.

    A fresh buffer per receive put an allocator call between a sent result and the post of the
    next receive, the path of every layer's round trip: at 1-16 tokens that cost 0.15-0.3x of a
    raw Gloo round trip (measured), far more than the call's own time, the allocator's code being
    cold after each wait. Two turns are enough: a (layer, stage)'s buffer is posted again for
    layer + 2 only after the result of layer + 1 went out (the FFN loop serves in order; the
    contract's ``recv_layer`` promises the rows until then), and only the peer's rows of layer +
    2 land in it, which the peer sends after it took both results. In-order device transports
    (NCCL, HCCL) keep that order on their stream: the receive is queued after both sends. A
    buffer grows to the largest message it carried and keeps its last view, so a step of equal
    stages allocates and views nothing after its first two layers.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, top_k: int, with_routing: bool,
                 device: torch.device):
        self._hidden_size, self._dtype = hidden_size, dtype
        self._with_routing, self._device = with_routing, device
        self._row_bytes = (hidden_size * dtype.itemsize
                           + (routing_nbytes(1, top_k) if with_routing else 0))
        # (stage, source) -> [slot taken last, the other], turned before each take
        self._rows: dict[tuple[int, int], list[_Slot]] = {}
        self._counts: dict[tuple[int, int], list[torch.Tensor]] = {}

    def message(self, stage: int, source: int, rows: int) -> torch.Tensor:
        """A buffer for ``rows`` rows from ``source`` in the message layout above."""
        ring = self._rows.get((stage, source))
        if ring is None:
            ring = self._rows[stage, source] = [_Slot(), _Slot()]
        ring.reverse()
        slot = ring[0]
        if slot.rows == rows:
            return slot.view
        storage = slot.storage
        nbytes = rows * self._row_bytes
        if storage is None or storage.numel() < nbytes:
            storage = slot.storage = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        view = storage[:nbytes]
        if not self._with_routing:
            view = view.view(self._dtype).view(rows, self._hidden_size)
        slot.rows, slot.view = rows, view
        return view

    def count(self, stage: int, source: int) -> torch.Tensor:
        """A buffer for a row count (int64 [1])."""
        ring = self._counts.get((stage, source))
        if ring is None:
            ring = self._counts[stage, source] = [
                torch.empty(1, dtype=torch.int64, device=self._device) for _ in range(2)]
        ring.reverse()
        return ring[0]


class _Slot:
    __slots__ = ("rows", "view", "storage")

    def __init__(self):
        self.rows, self.view, self.storage = -1, None, None


def unpack(buf: torch.Tensor, rows: int, hidden_size: int, dtype: torch.dtype, top_k: int,
           with_routing: bool):
    """(hidden, topk_ids, topk_weights) viewed in place from a received message."""
    if not with_routing:
        return buf, None, None
    n = rows * top_k * 4
    ids = buf[:n].view(torch.int32).view(rows, top_k)
    weights = buf[n:2 * n].view(torch.float32).view(rows, top_k)
    hidden = buf[2 * n:].view(dtype).view(rows, hidden_size)
    return hidden, ids, weights


def open_p2p_world(connector, backend: str | None = None) -> SyncLinks:
    """Rendezvous, handshake and groups for either half of the P2P connector; ``backend``
    "loopback" for the loopback connector (afd_common.transport.loopback), else the configured
    one."""
    cfg, topo = connector.config, connector.topology
    backend = backend or cfg.extra.backend or default_backend(connector.device)
    world = open_world(connector)
    try:
        in_order = inorder.enabled()
        data_group = world.group("data", backend)
        # The control plane keeps tagged matching: its own host group (Gloo; loopback's own)
        # under NCCL and in the in-order test mode, which stands for NCCL; otherwise it shares
        # the data group.
        host = "loopback" if backend == "loopback" else "gloo"
        ctrl_group = (data_group if backend == host and not in_order
                      else world.group("control", host))
        data = PeerIO(data_group, world.describe, in_order=in_order)
        ctrl_io = data if ctrl_group is data_group else PeerIO(ctrl_group, world.describe)
        control = GlooControlPlane(ctrl_io, link_peers(topo, cfg.role, connector.local_rank),
                                   cfg.role, connector.timeouts.step_s)
    except BaseException:
        world.close()
        raise
    return SyncLinks(world, control, data)
