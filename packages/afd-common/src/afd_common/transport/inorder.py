"""NCCL/HCCL point-to-point matching, emulated on Gloo for tests (``AFD_TEST_INORDER=1``).

NCCL and HCCL ignore tags and run the point-to-point operations between one pair of ranks in
posting order, on one stream: a posted receive holds back everything posted after it to the same
peer. Gloo matches by tag, so on CPU an ordering that would deadlock on a GPU or an NPU runs fine.
With ``AFD_TEST_INORDER=1`` in every afd process, each data-plane group is wrapped so that this
rank's operations to one peer run one at a time, in posting order, each finished (a Gloo send
finishes when the peer has posted its receive) before the next starts: an order that is unsafe
under in-order matching then stops at the step timeout with an error naming the wait, on CPU.

The control plane keeps Gloo's tagged semantics, as it has in a real NCCL deployment (its own
Gloo group). Test mode only: one thread per peer and no overlap between a peer's operations.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from datetime import timedelta

logger = logging.getLogger("vllm.afd")

ENV = "AFD_TEST_INORDER"
_FOREVER = timedelta(days=3650)
_warned = False


def enabled() -> bool:
    """True when this process runs its data planes in posting order (logs once that it does)."""
    global _warned
    on = os.environ.get(ENV, "").strip() not in ("", "0")
    if on and not _warned:
        _warned = True
        logger.warning("AFD: %s=1: point-to-point operations run in posting order per peer, "
                       "tags ignored (NCCL/HCCL matching emulated on Gloo). A test mode.", ENV)
    return on


class _Work:
    """What ``send``/``recv`` return: completes when the lane ran the operation."""

    def __init__(self):
        self._done = threading.Event()
        self._error: BaseException | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = None if timeout is None else timeout.total_seconds()
        if not self._done.wait(seconds):
            raise RuntimeError(f"Timed out after {seconds:.0f} s under in-order matching "
                               f"({ENV}): an operation posted earlier to the same peer has not "
                               "completed")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()


class InOrderGroup:
    """A Gloo group whose ``send``/``recv`` to each peer run one at a time in posting order."""

    def __init__(self, group):
        self._group = group
        self._lanes: dict[int, queue.SimpleQueue] = {}
        self._lock = threading.Lock()

    def name(self) -> str:
        return "gloo"

    def send(self, tensors, dst: int, tag: int) -> _Work:
        return self._post(dst, self._group.send, tensors, tag)

    def recv(self, tensors, src: int, tag: int) -> _Work:
        return self._post(src, self._group.recv, tensors, tag)

    def __getattr__(self, attr):  # rank(), size(), shutdown(), ...
        return getattr(self._group, attr)

    def _post(self, peer: int, op, tensors, tag: int) -> _Work:
        work = _Work()
        with self._lock:
            lane = self._lanes.get(peer)
            if lane is None:
                lane = self._lanes[peer] = queue.SimpleQueue()
                threading.Thread(target=self._run, args=(peer, lane), daemon=True,
                                 name=f"afd-inorder-{peer}").start()
        lane.put((op, tensors, tag, work))
        return work

    @staticmethod
    def _run(peer: int, lane: queue.SimpleQueue) -> None:
        broken: BaseException | None = None
        while True:
            op, tensors, tag, work = lane.get()
            if broken is not None:  # a lane whose connection failed fails what follows
                work._finish(broken)
                continue
            try:
                op(tensors, peer, tag).wait(_FOREVER)
                work._finish()
            except RuntimeError as e:
                broken = e
                work._finish(e)
