"""The in-order test mode (AFD_TEST_INORDER=1): NCCL/HCCL matching on Gloo, and proof that it
catches an ordering that deadlocks under in-order matching while Gloo's tags hide it."""

import threading
import time
from datetime import timedelta

import pytest
import torch

from afd_common.errors import AFDPeerError
from afd_common.transport.inorder import InOrderGroup
from op_world import run_op_world


class _FakeWork:
    def __init__(self, log, what):
        self.log, self.what, self.release = log, what, threading.Event()

    def wait(self, timeout=None):
        self.log.append(("start", self.what))
        assert self.release.wait(5)
        self.log.append(("end", self.what))
        return True


class _FakeGroup:
    def __init__(self):
        self.log, self.works = [], {}

    def _op(self, what):
        self.works[what] = _FakeWork(self.log, what)
        return self.works[what]

    def send(self, tensors, peer, tag):
        return self._op(f"send{tag}->{peer}")

    def recv(self, tensors, peer, tag):
        return self._op(f"recv{tag}<-{peer}")


def _until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_a_posted_receive_holds_back_later_sends_to_the_same_peer_only():
    fake = _FakeGroup()
    group = InOrderGroup(fake)
    t = [torch.empty(1)]
    r = group.recv(t, 1, tag=5)
    s = group.send(t, 1, tag=6)   # different tag, same peer: must wait for the receive
    other = group.send(t, 2, tag=6)  # another peer: its own lane
    _until(lambda: "send6->2" in fake.works and "recv5<-1" in fake.works)
    time.sleep(0.1)
    assert "send6->1" not in fake.works
    with pytest.raises(RuntimeError, match="in-order"):
        s.wait(timedelta(seconds=0.1))
    fake.works["recv5<-1"].release.set()
    assert r.wait(timedelta(seconds=5))
    _until(lambda: "send6->1" in fake.works)
    fake.works["send6->1"].release.set()
    fake.works["send6->2"].release.set()
    assert s.wait(timedelta(seconds=5)) and other.wait(timedelta(seconds=5))


def _exchange(rank, group_name, in_order, reply_first):
    """Rank 0 plays the attention side of one MoE layer, rank 1 the FFN side."""
    from afd_common.transport.peer_io import PeerIO

    pg = torch._C._distributed_c10d._resolve_process_group(group_name)
    io = PeerIO(pg, lambda r: f"rank {r}", in_order=in_order)
    x = torch.arange(8, dtype=torch.float32)
    try:
        if rank == 0:
            out = torch.empty(8)
            if reply_first:  # the first round's order: post the reply's receive, then send
                pending = io.irecv(out, 1, 7, "the result")
                io.isend(x, 1, 7)
            else:
                io.isend(x, 1, 7)
                pending = io.irecv(out, 1, 7, "the result")
            io.wait(pending, 3.0)
            return bool(torch.equal(out, x * 2))
        got = io.wait(io.irecv(torch.empty(8), 0, 7, "the rows"), 6.0)
        io.isend(got * 2, 0, 7)
        io.flush(3.0)
        return True
    except AFDPeerError as e:  # a timeout, or the peer gone after its own
        return str(e)


@pytest.mark.multiproc
@pytest.mark.inorder
def test_inorder_mode_catches_receive_before_send():
    # Gloo's tags hide the problem; in-order matching (NCCL, HCCL) deadlocks on it.
    assert run_op_world(_exchange, 2, False, True) == [True, True]
    attention, ffn = run_op_world(_exchange, 2, True, True)
    assert isinstance(attention, str) and "in-order matching" in attention, attention
    assert isinstance(ffn, str) and "rank 0" in ffn, ffn
    # The order afd uses (send, then post the reply's receive) passes under in-order matching.
    assert run_op_world(_exchange, 2, True, False) == [True, True]


class _DeviceWork:
    """NCCL-like work: completes on the device after ``after_s``; wait() does not block."""

    def __init__(self, after_s):
        self.done_at = time.monotonic() + after_s
        self.waited = False

    def is_completed(self):
        return time.monotonic() >= self.done_at

    def wait(self, timeout=None):
        self.waited = True
        return True


class _NcclGroup:
    def __init__(self, after_s):
        self.after_s, self.works = after_s, []

    def name(self):
        return "nccl"

    def recv(self, tensors, src, tag):
        self.works.append(_DeviceWork(self.after_s))
        return self.works[-1]

    send = recv


def test_device_waits_are_bounded_by_the_step_timeout_and_real():
    """On NCCL/HCCL a receive is waited for on the CPU until it completed, at most the step
    timeout: the measured wait is the real one, and a lost peer is an error in bounded time."""
    from afd_common.transport.peer_io import PeerIO

    io = PeerIO(_NcclGroup(after_s=0.2), lambda r: f"FFN rank {r}")
    start = time.monotonic()
    io.wait(io.irecv(torch.empty(1), 1, 0, "the result"), 5.0)
    assert 0.2 <= time.monotonic() - start < 2.0 and io.group.works[-1].waited
    io = PeerIO(_NcclGroup(after_s=60), lambda r: f"FFN rank {r}")
    start = time.monotonic()
    with pytest.raises(AFDPeerError, match="no the result from FFN rank 1 within 0.3 s"):
        io.wait(io.irecv(torch.empty(1), 1, 0, "the result"), 0.3)
    assert time.monotonic() - start < 2.0


def test_a_send_never_taken_names_the_step_timeout():
    """A cut link may leave a send, not a receive, waiting: its error names the timeout too."""
    from afd_common.errors import AFDTimeoutError
    from afd_common.transport.peer_io import PeerIO

    io = PeerIO(_NcclGroup(after_s=60), lambda r: f"FFN rank {r}")
    io.isend(torch.empty(1), 1, 0)
    start = time.monotonic()
    with pytest.raises(AFDTimeoutError, match="FFN rank 1 did not take a message we sent within "
                                              "0.3 s"):
        io.flush(0.3)
    assert time.monotonic() - start < 2.0
