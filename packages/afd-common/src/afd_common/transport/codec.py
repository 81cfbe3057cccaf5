"""The wire codec: small, versioned, binary frames. Nothing off the wire is ever unpickled.

Frame layout (little endian)::

    0   2s  magic   b"AF"
    2   B   version WIRE_VERSION
    3   B   kind    FrameKind
    4   I   payload length in bytes
    8   ... payload

Payloads:

* ``STEP``  (control plane, once per step): ``q step, B step_kind, H num_stages,
  q stage_tokens[num_stages]``.
* ``HELLO`` (handshake): UTF-8 JSON object, at most ``MAX_JSON_BYTES``.

Hidden states are not framed: their shape is fixed by the step metadata and the model shape, so
they travel as raw tensors and the receiver preallocates exactly.

Every decoder either returns a value or raises ``AFDProtocolError``.
"""

from __future__ import annotations

import enum
import json
import struct
from typing import Any

from afd_common.errors import AFDProtocolError
from afd_common.metadata import MAX_STAGES, StepKind, StepMetadata

MAGIC = b"AF"
WIRE_VERSION = 1
_HEADER = struct.Struct("<2sBBI")
_STEP_HEAD = struct.Struct("<qBH")
MAX_JSON_BYTES = 64 * 1024
MAX_TOKENS = 1 << 40

# A STEP frame always fits here, so the control plane sends one fixed-size message per step.
STEP_FRAME_BYTES = _HEADER.size + _STEP_HEAD.size + 8 * MAX_STAGES


_STEP_KINDS = {kind.value: kind for kind in StepKind}


class FrameKind(enum.IntEnum):
    STEP = 1
    HELLO = 2


def _frame(kind: FrameKind, payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, WIRE_VERSION, int(kind), len(payload)) + payload


def _unframe(data: bytes, expected: FrameKind) -> bytes:
    if len(data) < _HEADER.size:
        raise AFDProtocolError(f"frame of {len(data)} bytes is shorter than its header")
    magic, version, kind, length = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise AFDProtocolError(f"bad magic {magic!r}: the peer is not an afd process")
    if version != WIRE_VERSION:
        raise AFDProtocolError(f"wire protocol version {version} from the peer, ours is "
                               f"{WIRE_VERSION}: install the same afd version on both roles")
    if kind != expected:
        name = FrameKind(kind).name if kind in FrameKind._value2member_map_ else str(kind)
        raise AFDProtocolError(f"expected a {expected.name} frame, got {name}")
    if length > len(data) - _HEADER.size:
        raise AFDProtocolError(f"frame announces {length} payload bytes, "
                               f"{len(data) - _HEADER.size} present")
    return bytes(data[_HEADER.size:_HEADER.size + length])


#: A STEP frame's header and payload head in one, and the stage counts' layout by their number:
#: packed and unpacked at once on the path from a step's start to its first rows.
_STEP_FRAME_HEAD = struct.Struct("<2sBBIqBH")
_STAGE_TOKENS = [struct.Struct(f"<{n}q") for n in range(MAX_STAGES + 1)]
_STEP = int(FrameKind.STEP)
_ZEROS = memoryview(bytes(STEP_FRAME_BYTES))
#: What the compiled link's copies of ``encode_step_into`` and ``decode_step`` (csrc/one_link.cpp:
#: the attention half's ``begin_step``, the FFN half's ``recv_step``) take from here: magic,
#: version, frame kind, frame size, the bound of a stage's count. The layout itself is written
#: there again; tests/test_one_link.py holds both to the codec's bytes and decisions.
STEP_FRAME = (MAGIC.decode(), WIRE_VERSION, _STEP, STEP_FRAME_BYTES, MAX_TOKENS)


def encode_step_into(meta: StepMetadata, buf) -> int:
    """Write ``meta``'s STEP frame at the start of ``buf`` (writable, ``STEP_FRAME_BYTES`` long:
    the control plane's send slot), zeros after it; its length. In place: this runs between a
    step's start and its plan's send, which the FFN side's first rows wait for."""
    tokens = meta.stage_tokens
    n = len(tokens)
    if not 1 <= n <= MAX_STAGES:
        raise ValueError(f"num_stages {n} not in [1, {MAX_STAGES}]")
    if meta.step < 0 or min(tokens) < 0 or max(tokens) >= MAX_TOKENS:
        raise ValueError(f"step {meta.step} / stage tokens {tokens} out of range")
    head = _STEP_FRAME_HEAD.size
    _STEP_FRAME_HEAD.pack_into(buf, 0, MAGIC, WIRE_VERSION, _STEP, _STEP_HEAD.size + 8 * n,
                               meta.step, int(meta.kind), n)
    _STAGE_TOKENS[n].pack_into(buf, head, *tokens)
    end = head + 8 * n
    buf[end:] = _ZEROS[end:]
    return end


def encode_step(meta: StepMetadata) -> bytes:
    buf = bytearray(STEP_FRAME_BYTES)
    return bytes(buf[:encode_step_into(meta, buf)])


def decode_step(data: bytes) -> StepMetadata:
    if len(data) >= _STEP_FRAME_HEAD.size:
        magic, version, kind, length, step, kind_value, num_stages = (
            _STEP_FRAME_HEAD.unpack_from(data))
        step_kind = _STEP_KINDS.get(kind_value)
        if (magic == MAGIC and version == WIRE_VERSION and kind == _STEP and step >= 0
                and step_kind is not None and 1 <= num_stages <= MAX_STAGES
                and length == _STEP_HEAD.size + 8 * num_stages
                and len(data) >= _HEADER.size + length):
            tokens = _STAGE_TOKENS[num_stages].unpack_from(data, _STEP_FRAME_HEAD.size)
            if min(tokens) >= 0 and max(tokens) < MAX_TOKENS:
                return StepMetadata(step, step_kind, tokens)
    return _decode_step_checking(data)  # raises, naming what is wrong


def _decode_step_checking(data: bytes) -> StepMetadata:
    payload = _unframe(data, FrameKind.STEP)
    if len(payload) < _STEP_HEAD.size:
        raise AFDProtocolError(f"STEP payload of {len(payload)} bytes is too short")
    step, kind_value, num_stages = _STEP_HEAD.unpack_from(payload)
    kind = _STEP_KINDS.get(kind_value)
    if kind is None:
        raise AFDProtocolError(f"unknown step kind {kind_value}")
    if not 1 <= num_stages <= MAX_STAGES:
        raise AFDProtocolError(f"num_stages {num_stages} not in [1, {MAX_STAGES}]")
    if len(payload) != _STEP_HEAD.size + 8 * num_stages:
        raise AFDProtocolError(f"STEP payload of {len(payload)} bytes does not hold "
                               f"{num_stages} stages")
    if step < 0:
        raise AFDProtocolError(f"negative step {step}")
    tokens = struct.unpack_from(f"<{num_stages}q", payload, _STEP_HEAD.size)
    if min(tokens) < 0 or max(tokens) >= MAX_TOKENS:
        raise AFDProtocolError(f"stage token counts out of range: {tokens}")
    return StepMetadata(step=step, kind=kind, stage_tokens=tokens)


def encode_json(obj: dict[str, Any]) -> bytes:
    payload = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    if len(payload) > MAX_JSON_BYTES:
        raise ValueError(f"JSON payload of {len(payload)} bytes exceeds {MAX_JSON_BYTES}")
    return _frame(FrameKind.HELLO, payload)


def decode_json(data: bytes) -> dict[str, Any]:
    payload = _unframe(data, FrameKind.HELLO)
    if len(payload) > MAX_JSON_BYTES:
        raise AFDProtocolError(f"JSON payload of {len(payload)} bytes exceeds {MAX_JSON_BYTES}")
    try:
        obj = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise AFDProtocolError(f"malformed JSON payload: {e}") from None
    if not isinstance(obj, dict):
        raise AFDProtocolError(f"JSON payload is a {type(obj).__name__}, expected an object")
    return obj
