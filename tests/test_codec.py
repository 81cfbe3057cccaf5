"""The wire codec round-trips, and every other input raises AFDProtocolError (fuzzed)."""

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_common.transport import codec
from afd_common.errors import AFDProtocolError
from afd_common.metadata import MAX_STAGES, StepKind, StepMetadata

steps = st.builds(StepMetadata, st.integers(0, 2**62), st.sampled_from(list(StepKind)),
                  st.lists(st.integers(0, 2**40 - 1), min_size=1, max_size=MAX_STAGES)
                  .map(tuple))


@settings(max_examples=500, deadline=None)
@given(steps)
def test_step_roundtrip(meta):
    frame = codec.encode_step(meta)
    assert len(frame) <= codec.STEP_FRAME_BYTES
    assert codec.decode_step(frame) == meta
    # Through the fixed-size slot the control plane sends from, written over an older frame
    # (its tail zeroed), and decoded where it lands.
    slot = bytearray(b"\xff" * codec.STEP_FRAME_BYTES)
    assert codec.encode_step_into(meta, memoryview(slot)) == len(frame)
    assert slot[:len(frame)] == frame and not any(slot[len(frame):])
    assert codec.decode_step(memoryview(slot)) == meta


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=700))
def test_decode_step_never_crashes(data):
    try:
        codec.decode_step(data)
    except AFDProtocolError:
        pass


@settings(max_examples=2000, deadline=None)
@given(steps, st.data())
def test_mutated_step_frames_decode_or_refuse(meta, data):
    frame = bytearray(codec.encode_step(meta))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    try:
        out = codec.decode_step(bytes(frame))
    except AFDProtocolError:
        return
    assert 1 <= out.num_stages <= MAX_STAGES and out.step >= 0


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=300))
def test_decode_json_never_crashes(data):
    for candidate in (data, codec._HEADER.pack(codec.MAGIC, codec.WIRE_VERSION,
                                               codec.FrameKind.HELLO, len(data)) + data):
        try:
            assert isinstance(codec.decode_json(candidate), dict)
        except AFDProtocolError:
            pass


def test_json_roundtrip_and_refusals():
    assert codec.decode_json(codec.encode_json({"a": [1, 2]})) == {"a": [1, 2]}
    with pytest.raises(AFDProtocolError, match="expected a HELLO"):
        codec.decode_json(codec.encode_step(StepMetadata(0, StepKind.RUN, (1,))))
    bad_version = bytearray(codec.encode_json({}))
    bad_version[2] = 99
    with pytest.raises(AFDProtocolError, match="version 99"):
        codec.decode_json(bytes(bad_version))
    with pytest.raises(AFDProtocolError, match="magic"):
        codec.decode_json(b"PK" + bytes(bad_version[2:]))
    lying = codec._HEADER.pack(codec.MAGIC, codec.WIRE_VERSION, codec.FrameKind.HELLO, 10**6)
    with pytest.raises(AFDProtocolError, match="announces"):
        codec.decode_json(lying + b"{}")
    array = codec._HEADER.pack(codec.MAGIC, codec.WIRE_VERSION, codec.FrameKind.HELLO, 2)
    with pytest.raises(AFDProtocolError, match="expected an object"):
        codec.decode_json(array + b"[]")
    with pytest.raises(AFDProtocolError, match="stages"):
        payload = struct.pack("<qBH", 0, 0, 0)
        codec.decode_step(codec._frame(codec.FrameKind.STEP, payload))
