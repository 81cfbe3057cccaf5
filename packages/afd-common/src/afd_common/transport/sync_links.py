"""The world of a sync connector's half (P2P, CAMP2p): the control plane that announces each
step, the data I/O where the rows move by point-to-point operations, and an orderly close.

A sync connector's FFN side learns each step's token counts from the control plane before any
hidden state moves, so every receive is sized by them (the bookkeeping is
``ScheduledFFNConnector``'s, afd_common.contract; the P2P connector's compiled link posts a step's
first receive ahead, sized by the bound they are held to).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from afd_common.transport.control_plane import GlooControlPlane
from afd_common.metadata import StepMetadata
from afd_common.transport.peer_io import PeerIO
from afd_common.transport.world import AFDWorld

WATCH_TAG = 0x7FFE  # never sent: a receive on it only ends when the connection does


@dataclass
class SyncLinks:
    """``data`` is the P2P connector's data I/O (None for connectors whose data moves through
    compiled ops); ``on_close`` undoes registrations (afd_common.contract.Net)."""

    world: AFDWorld
    control: GlooControlPlane
    data: PeerIO | None = None
    on_close: list = field(default_factory=list)

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """The peers across this half's links, watched on the control plane."""
        self.control.io.watch(list(self.control.peers), WATCH_TAG,
                              lambda peer, reason: on_lost(reason))

    def goodbye(self, stop: StepMetadata, settle_s: float) -> None:
        """An attention half's last word: a STOP step, so the FFN side's runner ends cleanly."""
        self._quiet()
        self.control.send_step(stop)
        self.control.io.flush(settle_s)

    def _quiet(self) -> None:
        """A peer that goes away from now on is no loss: this half is closing."""
        for io in (self.data, self.control.io):
            if io is not None:
                io.closing = True

    def close(self, settle_s: float = 0.0) -> None:
        self._quiet()
        try:
            if settle_s:
                (self.data or self.control.io).flush(settle_s)
        except Exception:  # noqa: BLE001 - the peer may be gone; closing must not fail
            pass
        self.world.close()  # first: no operation of the groups is in flight after it
        for undo in self.on_close:
            undo()
