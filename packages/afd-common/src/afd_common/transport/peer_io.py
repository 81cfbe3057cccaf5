"""Point-to-point over a formed group: sends that never block, receives bounded and named.

``PeerIO`` is what every connector's data path and control plane move their messages with
(Gloo's works waited on the host, NCCL/HCCL works polled: ``wait_device_work``); the groups
themselves are formed in ``afd_common.transport.process_groups``.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from afd_common.errors import AFDPeerError, AFDTimeoutError
from afd_common.metadata import new_tuple
from afd_common.transport.inorder import InOrderGroup

# Waiting for the next step is not bounded: a role may be idle for days. A dead peer still ends
# the wait at once (its connection closes).
IDLE_WAIT = timedelta(days=3650)


class PendingRecv(NamedTuple):
    """A posted receive. A tuple: one is made per layer and source on the path of every round
    trip."""

    work: object
    tensor: torch.Tensor
    src: int
    what: str | tuple  # a format string and its arguments, formatted only for an error

    def describe(self) -> str:
        return self.what if isinstance(self.what, str) else self.what[0].format(*self.what[1:])


#: Bounds as Gloo takes them, by seconds (None: an idle wait). Read on every layer's path, so
#: looked up in place (``_timedeltas.get(s) or _seconds(s)``) rather than through a call.
_timedeltas: dict[float | None, timedelta] = {None: IDLE_WAIT}


def _seconds(timeout_s: float | None) -> timedelta:
    td = _timedeltas.get(timeout_s)
    if td is None:
        td = _timedeltas[timeout_s] = timedelta(seconds=timeout_s)
    return td


class PeerIO:
    """Point-to-point on one group: sends never block, receives are bounded and named.

    Gloo reads a sent tensor after ``send`` returns and only learns that the peer took it inside
    ``wait``, so each send is kept (tensor alive) until it is known to be done. A reply from a
    peer proves that the peer received everything we sent it before the reply's wait began, so
    those sends are waited on (bounded; done by then, unless a later micro-batch's send is still
    on its way) at the next wait for that peer, just before it blocks: never between a receive
    and the next send, nor between that send and the post of the receive its answer needs (the
    path of every layer's round trip). ``flush`` settles the rest with a bound.
    """

    def __init__(self, group: dist.ProcessGroup, describe_rank, in_order: bool = False):
        """``in_order``: a data plane under ``AFD_TEST_INORDER``
        (``afd_common.transport.inorder``)."""
        self._describe = describe_rank  # global rank -> "FFN rank 1" etc.
        self._pending: dict[int, list[tuple[object, torch.Tensor]]] = {}
        # peer -> how many of our first sends to it in ``_pending`` its last reply proved taken
        self._proved: dict[int, int] = {}
        # Waited on the host, like Gloo's works (not a device stream's).
        self.is_gloo = backend_name(group) in ("gloo", "loopback")
        self.in_order = in_order and self.is_gloo
        self.group = InOrderGroup(group) if self.in_order else group
        self.closing = False

    def isend(self, tensor: torch.Tensor, dst: int, tag: int):
        """Post a send; its work (kept here until known done, see the class docstring)."""
        try:
            work = self.group.send([tensor], dst, tag)
        except RuntimeError as e:
            raise self.failure("send", dst, None, None, str(e)) from None
        self._keep(dst, work, tensor)
        return work

    def irecv(self, tensor: torch.Tensor, src: int, tag: int, what: str | tuple) -> PendingRecv:
        """Post a receive now (so the transport can land data early); wait for it later."""
        try:
            work = self.group.recv([tensor], src, tag)
        except RuntimeError as e:
            raise self.failure("post", src, what, None, str(e)) from None
        return new_tuple(PendingRecv, (work, tensor, src, what))

    def send_then_post(self, tensor: torch.Tensor, dst: int, tag: int, buf: torch.Tensor,
                       src: int, recv_tag: int, what: str | tuple) -> PendingRecv:
        """``isend`` then ``irecv``, with nothing done between the two calls. On the path of every
        layer's round trip a receive posted even a few microseconds after the send before it
        loses the race with the peer's answer more often, and Gloo then holds that answer back
        for a notification round trip (measured: ``afd_attention.p2p_connector``)."""
        group = self.group
        try:
            work = group.send([tensor], dst, tag)
        except RuntimeError as e:
            raise self.failure("send", dst, None, None, str(e)) from None
        try:
            posted = group.recv([buf], src, recv_tag)
        except RuntimeError as e:
            self._keep(dst, work, tensor)
            raise self.failure("post", src, what, None, str(e)) from None
        self._keep(dst, work, tensor)
        return new_tuple(PendingRecv, (posted, buf, src, what))

    def _keep(self, dst: int, work, tensor: torch.Tensor) -> None:
        """Hold a send until it is known done (the class docstring)."""
        sends = self._pending.get(dst)
        if sends is None:
            self._pending[dst] = [(work, tensor)]
        else:
            sends.append((work, tensor))

    def failure(self, kind: str, peer: int, what: str | tuple | None, timeout_s: float | None,
                error: str) -> AFDPeerError:
        """The error for a failed operation with ``peer``, by ``kind``: "send" or "post" (a
        send's or a receive's posting), "wait" (a receive's wait, ``what`` it awaited) or
        "settle" (a send's wait). Also how the compiled link's failures are worded
        (``afd_common.transport.one_link``)."""
        where, line = self._describe(peer), first_line_of(error)
        if kind == "send":
            return AFDPeerError(f"send to {where} failed: {line}")
        if kind == "settle":
            if is_timeout_message(error):
                return AFDTimeoutError(f"{where} did not take a message we sent within "
                                       f"{timeout_s} s: {line}")
            return AFDPeerError(f"{where} did not take a message we sent: {line}")
        what = PendingRecv(None, None, peer, what).describe()
        if kind == "post":
            return AFDPeerError(f"lost {where} before receiving {what}: {line}")
        if is_timeout_message(error):
            hint = (" -- or, under in-order matching, an operation posted earlier on this "
                    "link never completed" if self.in_order else "")
            return AFDTimeoutError(f"no {what} from {where} within {timeout_s} s (is the peer "
                                   f"alive and in the same step?{hint})")
        return AFDPeerError(f"lost {where} while waiting for {what}: {line}")

    def wait(self, pending: PendingRecv, timeout_s: float | None) -> torch.Tensor:
        """``timeout_s=None``: wait until the data or the connection's end (idle waits)."""
        work, tensor, src, _ = pending
        sends = self._pending.get(src)
        if sends:
            proved = self._proved.get(src)
            if proved:
                self._settle(src, 60.0 if timeout_s is None else timeout_s, proved)
            # What this reply will prove taken.
            self._proved[src] = len(sends)
        try:
            if self.is_gloo:
                work.wait(_timedeltas.get(timeout_s) or _seconds(timeout_s))
            else:
                wait_device_work(work, timeout_s)
        except RuntimeError as e:
            self._proved.pop(src, None)
            raise self.failure("wait", src, pending.what, timeout_s, str(e)) from None
        return tensor

    def _settle(self, dst: int, timeout_s: float, count: int | None = None) -> None:
        """Wait for our sends to ``dst``: the first ``count`` (those a reply proved), or all."""
        sends = self._pending.get(dst)
        if not sends:
            return
        # In place: ``wait`` reads what is left through the same list.
        n = len(sends) if count is None else count
        done = sends[:n]
        del sends[:n]
        self._proved.pop(dst, None)
        bound = (_timedeltas.get(timeout_s) or _seconds(timeout_s)) if self.is_gloo else None
        for work, _ in done:
            try:
                if bound is not None:
                    work.wait(bound)
                else:
                    wait_device_work(work, timeout_s)
            except RuntimeError as e:
                raise self.failure("settle", dst, None, timeout_s, str(e)) from None

    def settle_older(self, timeout_s: float) -> None:
        """Wait (bounded) for every send to each peer but the last."""
        for dst, sends in self._pending.items():
            if len(sends) > 1:
                self._settle(dst, timeout_s, len(sends) - 1)

    def flush(self, timeout_s: float) -> None:
        """Wait (bounded) until every peer took what we sent."""
        for dst in list(self._pending):
            self._settle(dst, timeout_s)

    def watch(self, peers: list[int], tag: int, on_lost) -> None:
        """Learn, without polling, when the connection to a peer drops: one daemon thread per
        peer waits on a receive the peer never sends. ``on_lost(peer, reason)`` runs in that
        thread unless ``closing`` was set first (a normal shutdown)."""
        for peer in peers:
            def run(peer=peer, buf=torch.empty(1, dtype=torch.uint8)):
                try:
                    self.group.recv([buf], peer, tag).wait(IDLE_WAIT)
                except RuntimeError as e:
                    if not self.closing:
                        on_lost(peer, f"lost {self._describe(peer)}: {first_line(e)}")
            threading.Thread(target=run, daemon=True, name=f"afd-watch-{peer}").start()


def wait_device_work(work, timeout_s: float | None) -> None:
    """Wait for NCCL/HCCL work within ``timeout_s``, on the CPU.

    There ``Work.wait()`` only orders the current stream after the operation (or, with blocking
    waits, blocks for the whole group timeout): a lost peer would surface long after the step
    timeout. So completion is polled (the event query does not block), then ``wait()`` orders the
    stream and raises the operation's own error, if any. When this returns, the data is there:
    the time measured around it is the real wait, not the enqueue.
    """
    end = None if timeout_s is None else time.monotonic() + timeout_s
    spins = 0
    while not work.is_completed():
        if end is not None and time.monotonic() > end:
            raise RuntimeError(f"Timed out after {timeout_s} s waiting for the operation to "
                               "complete on the device")
        spins += 1
        if spins > 200:
            time.sleep(50e-6)
    work.wait()


def backend_name(group) -> str:
    try:
        return group.name().lower()
    except Exception:  # noqa: BLE001 - a wrapper without name(): assume the CPU transport
        return "gloo"


def is_timeout(e: BaseException) -> bool:
    return is_timeout_message(str(e))


def is_timeout_message(msg: str) -> bool:
    msg = msg.lower()
    return "timed out" in msg or "timeout" in msg


def first_line(e: BaseException) -> str:
    return first_line_of(str(e), type(e).__name__)


def first_line_of(msg: str, empty: str = "RuntimeError") -> str:
    msg = msg.strip()
    return msg.splitlines()[0] if msg else empty
