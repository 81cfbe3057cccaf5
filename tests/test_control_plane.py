"""The Gloo control plane's sending side: each step's plan goes out from one of two preallocated
frames, and a frame is never written again while a send of it may still be read."""

from afd_common.metadata import StepKind, StepMetadata
from afd_common.transport.codec import decode_step
from afd_common.transport.control_plane import GlooControlPlane


class Work:
    def __init__(self, done: bool):
        self.done = done

    def is_completed(self) -> bool:
        return self.done


class SendsIO:
    """The sends as posted (the frame, its bytes then, its work), each done or not as told."""

    def __init__(self):
        self.sent, self.done, self.settled = [], True, 0

    def isend(self, tensor, dst, tag):
        work = Work(self.done)
        self.sent.append((tensor, bytes(tensor.numpy()), work))
        return work

    def settle_older(self, timeout_s):
        self.settled += 1


def test_a_frame_is_written_again_only_once_its_send_is_done():
    io = SendsIO()
    control = GlooControlPlane(io, {1: 0}, "attention", 1.0)
    control.send_step(StepMetadata(0, StepKind.RUN, (1,)))
    io.done = False  # as a failure leaves it: a settle that timed out
    control.send_step(StepMetadata(1, StepKind.RUN, (2, 3)))
    io.done = True
    control.send_step(StepMetadata(2, StepKind.RUN, (4,)))
    control.send_step(StepMetadata(3, StepKind.STOP, (0,)))
    frames = [t for t, _, _ in io.sent]
    assert frames[2] is frames[0]  # its send was done: the slot is reused
    assert frames[3] is not frames[1]  # step 1's send may still read its frame: a new one
    assert decode_step(memoryview(frames[1].numpy())) == StepMetadata(1, StepKind.RUN, (2, 3))
    for (_, sent, _), step in zip(io.sent, range(4)):
        assert decode_step(sent).step == step
    assert io.settled == 4


def test_a_plan_refused_by_the_codec_leaves_the_turn_where_it_was():
    io = SendsIO()
    control = GlooControlPlane(io, {1: 0}, "attention", 1.0)
    control.send_step(StepMetadata(0, StepKind.RUN, (1,)))
    io.done = False
    control.send_step(StepMetadata(1, StepKind.RUN, (1,)))
    try:
        control.send_step(StepMetadata(2, StepKind.RUN, (-1,)))
    except ValueError:
        pass
    else:
        raise AssertionError("a negative count was encoded")
    control.send_step(StepMetadata(2, StepKind.RUN, (1,)))
    frames = [t for t, _, _ in io.sent]
    assert len(frames) == 3 and frames[2] is frames[0] and frames[2] is not frames[1]
