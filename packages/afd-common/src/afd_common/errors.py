"""The project's own error types.

Every failure a user can cause or meet (bad config, a peer that is gone, a malformed frame, a role
that does not match its peer) surfaces as one of these, so callers and the fuzz tests can tell an
expected refusal from a bug.
"""

from __future__ import annotations


class AFDError(Exception):
    """Base of every error raised on purpose by afd."""


class AFDConfigError(AFDError, ValueError):
    """The ``afd`` section of ``additional_config`` is invalid. Names the field and the value."""

    def __init__(self, field: str, value: object, problem: str):
        self.field = field
        self.value = value
        super().__init__(f"afd config: field {field!r} = {value!r}: {problem}")


class AFDProtocolError(AFDError):
    """A frame off the wire could not be decoded (bad magic, version, kind or length)."""


class AFDHandshakeError(AFDError):
    """The two roles do not belong together (fingerprint mismatch or failed authentication)."""


class AFDPeerError(AFDError):
    """A peer rank stopped answering: it died, closed the connection, or sent something unexpected."""


class AFDRendezvousClosingError(AFDPeerError):
    """The rendezvous found belongs to a world this process already left and is still closing:
    its store outlived the peer that hosts it by a moment (a rolling restart). Trying again
    finds the next one."""


class AFDTimeoutError(AFDPeerError, TimeoutError):
    """A bounded wait on a peer ran out."""
