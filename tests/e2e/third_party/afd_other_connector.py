"""A third-party connector, found only through its own entry point (this folder's dist-info):
the P2P attention half under another name and wire protocol. The mismatch test starts an
attention role with it, so the FFN role meets a connector it does not speak."""

from afd_attention.p2p_connector import P2pAttentionConnector


class OtherAttentionConnector(P2pAttentionConnector):
    protocol = "other-p2p/1"
