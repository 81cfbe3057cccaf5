"""A third-party connector, found only through its own entry point (this folder's dist-info):
the P2P FFN half under another name and wire protocol. The mismatch test starts the FFN role with
it, so the attention role meets a connector it does not speak."""

from afd_ffn.p2p_connector import P2pFFNConnector


class OtherFFNConnector(P2pFFNConnector):
    protocol = "other-p2p/1"
