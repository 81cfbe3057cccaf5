"""The transport runtime both roles' connector halves use: forming a world (rendezvous, handshake,
process groups), the wire format, the control plane, and each connector family's world layout."""
