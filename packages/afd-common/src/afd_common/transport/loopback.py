"""The loopback transport: every rank of an AFD world in one process, the rows moved through
in-process mailboxes instead of a network.

``LoopbackAFDConnector`` is the P2P connector over it (``open_p2p_world(..., backend=
"loopback")``): the same rendezvous and handshake, the same message layout and order of
operations, but no Gloo group, so both roles' halves can run in the threads of one test, in
milliseconds per step, and a rank can be made to vanish at any point (``LoopbackGroup.shutdown``,
as a dead peer's connection closes). It is for tests and examples: with the roles in two
processes it refuses to form a world, saying so.

Semantics follow Gloo's, which the connectors are written against: messages between a pair of
ranks match by tag, in posting order per tag; a send completes once the peer posted the matching
receive; a receive completes with the data, fails when its peer left, or times out; the sizes
must agree exactly.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist

PROTOCOL = "loopback/1"  # the P2P wire, but never to be met by a P2P half in another process

_hubs: dict[str, _Hub] = {}
_hubs_lock = threading.Lock()
HUB_KEY = "loopback/hub"


class _Hub:
    """The mailboxes of one loopback group."""

    def __init__(self, size: int):
        self.size = size
        self.cond = threading.Condition()
        self.messages: dict[tuple[int, int, int, int], torch.Tensor] = {}  # (src, dst, tag, n)
        self.sent: Counter = Counter()  # (src, dst, tag) -> messages sent
        self.posted: Counter = Counter()  # (src, dst, tag) -> receives posted
        self.left: set[int] = set()


class _Work:
    """What ``send``/``recv`` return, like a Gloo work: ``wait(timeout)`` raises RuntimeError on
    a timeout or a peer that left."""

    def __init__(self, hub: _Hub, me: int, peer: int, ready, finish, what: str):
        self._hub, self._me, self._peer = hub, me, peer
        self._ready, self._finish, self._what = ready, finish, what
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._done:
            return True
        hub = self._hub
        seconds = None if timeout is None else timeout.total_seconds()
        with hub.cond:
            hub.cond.wait_for(lambda: self._ready() or bool({self._me, self._peer} & hub.left),
                              seconds)
            if self._ready():
                self._finish()
                self._done = True
                return True
            if hub.left & {self._me, self._peer}:
                who = "this rank" if self._me in hub.left else f"loopback rank {self._peer}"
                raise RuntimeError(f"Connection closed by peer: {who} left the loopback group "
                                   f"({self._what})")
        raise RuntimeError(f"Timed out after {seconds:g} s: {self._what}")

    def is_completed(self) -> bool:
        with self._hub.cond:
            return self._done or self._ready()


class LoopbackGroup:
    """The point-to-point half of a process group, as ``PeerIO``
    (afd_common.transport.peer_io) uses it."""

    def __init__(self, hub: _Hub, key: str, rank: int):
        self._hub, self._key, self._rank = hub, key, rank

    def name(self) -> str:
        return "loopback"

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._hub.size

    def _check(self, tensors, peer: int) -> torch.Tensor:
        if len(tensors) != 1 or not 0 <= peer < self._hub.size or peer == self._rank:
            raise ValueError(f"loopback rank {self._rank}: one tensor to another rank of "
                             f"[0, {self._hub.size}), not {len(tensors)} to {peer}")
        return tensors[0]

    def _post(self, counts: Counter, key: tuple[int, int, int],
              message: torch.Tensor | None = None) -> int:
        """This operation's place in its (src, dst, tag) order; a send leaves its message."""
        hub = self._hub
        with hub.cond:
            if self._rank in hub.left:
                raise RuntimeError(f"Connection closed: loopback rank {self._rank} left its "
                                   "group")
            n = counts[key]
            counts[key] += 1
            if message is not None:
                hub.messages[(*key, n)] = message
            hub.cond.notify_all()
        return n

    def send(self, tensors, dst: int, tag: int) -> _Work:
        tensor, hub, key = self._check(tensors, dst), self._hub, (self._rank, dst, tag)
        # A copy now: Gloo reads the tensor after send returns, the peer may take it much later.
        n = self._post(hub.sent, key, tensor.detach().clone())
        return _Work(hub, self._rank, dst, lambda: hub.posted[key] > n, lambda: None,
                     f"rank {dst} to receive tag {tag}")

    def recv(self, tensors, src: int, tag: int) -> _Work:
        tensor, hub, key = self._check(tensors, src), self._hub, (src, self._rank, tag)
        me = self._rank
        n = self._post(hub.posted, key)

        def take() -> None:
            msg = hub.messages.pop((*key, n))
            if msg.nbytes > tensor.nbytes:  # Gloo's rule: a shorter message fits
                raise RuntimeError(f"message size mismatch: rank {src} sent {msg.nbytes} bytes "
                                   f"with tag {tag}, the receive posted {tensor.nbytes}")
            if msg.nbytes:
                tensor.view(-1).view(torch.uint8)[:msg.nbytes].copy_(
                    msg.reshape(-1).view(torch.uint8))

        return _Work(hub, me, src, lambda: (*key, n) in hub.messages, take,
                     f"a message from rank {src} with tag {tag}")

    def shutdown(self) -> None:
        """Leave the group: every wait on this rank, and every peer's wait on it, fails now (as
        a closed connection fails them on Gloo)."""
        hub = self._hub
        with hub.cond:
            hub.left.add(self._rank)
            hub.cond.notify_all()
            gone = len(hub.left) == hub.size
        if gone:
            with _hubs_lock:
                _hubs.pop(self._key, None)


_ids = itertools.count()


def join_group(store: dist.Store, rank: int, size: int) -> LoopbackGroup:
    """This rank's loopback group: rank 0 makes the mailboxes and names them in the world's
    store, the others find them by that name (bounded by the store's timeout)."""
    if rank == 0:
        key = f"{uuid.uuid4().hex}-{next(_ids)}"
        with _hubs_lock:
            _hubs[key] = _Hub(size)
        store.set(HUB_KEY, key)
    else:
        key = bytes(store.get(HUB_KEY)).decode()
    with _hubs_lock:
        hub = _hubs.get(key)
    if hub is None:
        raise RuntimeError("the loopback transport needs every rank of the AFD world in one "
                           "process; rank 0 of this world runs in another (use "
                           "P2pAFDConnector between processes)")
    return LoopbackGroup(hub, key, rank)
