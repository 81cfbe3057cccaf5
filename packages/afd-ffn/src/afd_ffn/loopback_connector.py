"""FFN half of ``LoopbackAFDConnector``: the P2P connector's data path with every rank of the
world in one process (afd_common.transport.loopback), for tests and examples."""

from __future__ import annotations

from afd_common.transport.loopback import PROTOCOL

from afd_ffn.p2p_connector import P2pFFNConnector


class LoopbackFFNConnector(P2pFFNConnector):
    protocol = PROTOCOL
    backend = "loopback"
