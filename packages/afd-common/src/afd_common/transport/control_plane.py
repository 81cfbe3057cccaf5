"""The Gloo control plane of the sync connectors (P2P, CAMP2p): one STEP frame per step per link.

It always runs on a small Gloo group, also when the data moves over NCCL or HCCL, so step
metadata never waits behind device streams. Where an attention rank's compiled link serves it
(afd_common.transport.one_link), that link sends the rank's plans itself, the same frames on the
same tag; this class still receives them on the FFN side and sends the STOP step.
"""

from __future__ import annotations

from collections import deque

import torch

from afd_common.transport.codec import STEP_FRAME_BYTES, decode_step, encode_step_into
from afd_common.contract import ControlPlane, StepPlan
from afd_common.errors import AFDPeerError, AFDProtocolError
from afd_common.metadata import StepMetadata
from afd_common.topology import Topology
from afd_common.transport.peer_io import PeerIO

CONTROL_TAG = 0x7FFF


class GlooControlPlane(ControlPlane):
    """``peers``: global rank -> local rank of each rank across this rank's links, in link
    order. ``StepPlan.per_source`` is keyed by the attention ranks' local ranks."""

    def __init__(self, io: PeerIO, peers: dict[int, int], role: str, send_timeout_s: float):
        self.io = io
        self.peers = peers
        self.role = role
        self._send_timeout_s = send_timeout_s
        # The FFN side's receives of the next steps' frames, oldest first: (slot, peer ->
        # posted receive). Two stay posted, so a frame (a STOP, too) never waits for its receive,
        # also while the receive of the one after is not posted yet.
        self._posted: deque[tuple[int, dict]] = deque()
        self._turn = 0
        # (slot, peer) -> that frame buffer and its bytes, two slots taken in turn (FFN side)
        self._frames: dict[tuple[int, int], tuple[torch.Tensor, memoryview]] = {}
        # The attention side's frames, two taken in turn, each with the sends of what it held
        # last: written again two steps later, once those are done (settle_older).
        self._outgoing = [(*_buffer(), []) for _ in range(2)] if role == "attention" else []
        self._send_turn = 0
        # Frames whose sends a failure left unsettled, with those sends: Gloo may still read
        # them (a role closes after such a failure, so they are few).
        self._unsettled: list[tuple] = []

    def send_step(self, meta: StepMetadata) -> None:
        # The plan goes out first: the FFN side's first rows wait for it (the step's start is the
        # one stretch of a step where both roles run code at once).
        turn = self._send_turn
        frame, buf, sent = self._outgoing[turn]
        if not all(work.is_completed() for work in sent):
            # A failure (a settle timed out) left its sends unsettled: a new frame for the slot.
            self._unsettled.append((frame, sent))
            frame, buf = _buffer()
            self._outgoing[turn] = frame, buf, []
        encode_step_into(meta, buf)
        self._outgoing[turn] = (frame, buf, [self.io.isend(frame, peer, CONTROL_TAG)
                                             for peer in self.peers])
        self._send_turn = 1 - turn
        # The step before's frames are long taken (the FFN side answered that step): settled,
        # their slot is free for the next step.
        self.io.settle_older(self._send_timeout_s)

    def _post(self) -> None:
        """The receives of one more step's frames. A slot's buffers are posted again only after
        the frame they held was decoded (copied out)."""
        slot = self._turn = 1 - self._turn
        frames = self._frames
        for p in self.peers:
            if (slot, p) not in frames:
                frames[slot, p] = _buffer()
        self._posted.append((slot, {
            p: self.io.irecv(frames[slot, p][0], p, CONTROL_TAG, "the next step's metadata")
            for p in self.peers}))

    def post_next(self) -> None:
        # The next steps' frames can land as soon as they are sent: Gloo holds back a send
        # whose receive is not posted, for a notification round trip.
        while len(self._posted) < 2:
            self._post()

    def recv_step(self, timeout_s: float | None) -> StepPlan:
        if not self._posted:
            self.post_next()
        slot, bufs = self._posted.popleft()
        per_source: dict[int, StepMetadata] = {}
        for peer, pending in bufs.items():
            self.io.wait(pending, timeout_s)
            # Straight from the buffer: decoding copies every value out.
            per_source[self.peers[peer]] = first = decoded(peer, self._frames[slot, peer][1])
        if len(per_source) > 1:
            (a0, first), *rest = per_source.items()
            for a, meta in rest:
                if (meta.step, meta.kind, meta.num_stages) != (first.step, first.kind,
                                                               first.num_stages):
                    raise AFDProtocolError(
                        f"attention ranks out of step: attention rank {a0} announced step "
                        f"{first.step} ({first.kind.name}, {first.num_stages} stages), "
                        f"attention rank {a} step {meta.step} ({meta.kind.name}, "
                        f"{meta.num_stages} stages)")
        return StepPlan(first.step, per_source)


def decoded(peer: int, frame) -> StepMetadata:
    """The plan in a STEP frame from global rank ``peer``, or the error naming it."""
    try:
        return decode_step(frame)
    except AFDProtocolError as e:
        raise AFDPeerError(f"malformed step metadata from global rank {peer}: {e}") from None


def _buffer() -> tuple[torch.Tensor, memoryview]:
    """A frame's buffer, to send from or receive into, and its bytes."""
    t = torch.zeros(STEP_FRAME_BYTES, dtype=torch.uint8)
    return t, memoryview(t.numpy())


def link_peers(topology: Topology, role: str, local_rank: int,
               global_rank_of=None) -> dict[int, int]:
    """Global rank -> local rank of the ranks across this rank's links, in link order."""
    global_rank_of = global_rank_of or topology.global_rank
    if role == "attention":
        return {global_rank_of("ffn", link.ffn_rank): link.ffn_rank
                for link in topology.links_of_attention(local_rank)}
    return {global_rank_of("attention", link.attention_rank): link.attention_rank
            for link in topology.links_of_ffn(local_rank)}
