"""The P2P connector's round trip on one Gloo link, compiled (``csrc/one_link.cpp``).

Where an attention rank's rows all go to one FFN rank and an FFN rank's come from one attention
rank (replicated experts, the routing computed on the FFN side, A:F 1:1), each MoE layer is a
send and the receive of its answer on each side. In Python that path ran 15-37 us of CPU per
layer above a bare loop of the same Gloo calls (``benchmarks/transport.py``): the code runs
cold after every wait, at 3-5x its hot cost, and the same logic rewritten minimally in Python
cost the same. Compiled, it does what the Python path does (the same order of operations, sends
kept until a reply proves them taken, bounded waits) at the bare loop's CPU, and the FFN half
posts each step's first receive before its plan (``afd_ffn.p2p_connector`` says why). While
the connector is open the link answers its per-layer primitives itself (``serve``), and a step's
start too, where the control plane's frames share the link's group: the attention half's
``begin_step`` writes the plan into one of two frames and sends it, the FFN half's ``recv_step``
receives, reads and begins it (a copy of the codec's STEP frame layout, which
tests/test_one_link.py holds to the codec's bytes and decisions). Paired steps at 1 token: the
first layer 33-44 us shorter with the attention half's than with the class's ``begin_step``, the
step 22-46 us.

It is used only on a Gloo group, outside the in-order test mode (a Python wrapper), when the
module was built (afd-common's build hook; without a C++ compiler the wheel is pure Python), and
unless ``AFD_ONE_LINK=0``. Every other path -- several links, sharded experts, routing from the
attention side, NCCL/HCCL -- stays in the connector's Python, and so do the checks that name
what is wrong: the compiled side refuses what it does not expect and the Python path raises.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from afd_common.errors import AFDPeerError
from afd_common.metadata import MAX_STAGES
from afd_common.transport.peer_io import PeerIO, first_line_of

logger = logging.getLogger("vllm.afd")
_REMEDY = ("reinstall afd-common to compile it against this torch (`uv sync --reinstall-package "
           "afd-common`, or `pip install --force-reinstall --no-deps afd-common`)")


def _load():
    """The compiled module, or None (the Python path serves): not built, built for another torch
    release, or not loadable -- the last two said once, with the remedy."""
    try:
        from afd_common.transport import _one_link
    except ModuleNotFoundError:  # not built (no compiler at install): the build hook said so
        return None
    except ImportError as e:
        logger.warning("AFD: the compiled one-link path does not load (%s); the P2P connector "
                       "runs its Python path: %s", e, _REMEDY)
        return None
    here = torch.__version__.split("+")[0]
    if _one_link.torch_version != here:
        logger.warning("AFD: the compiled one-link path was built against torch %s, this is "
                       "torch %s; the P2P connector runs its Python path: %s",
                       _one_link.torch_version, here, _REMEDY)
        return None
    if _one_link.max_stages != MAX_STAGES:  # its tags are layer * max_stages + stage
        logger.warning("AFD: the compiled one-link path lays out tags for %d stages, this afd "
                       "for %d; the P2P connector runs its Python path: %s",
                       _one_link.max_stages, MAX_STAGES, _REMEDY)
        return None
    return _one_link


_module = _load()
#: What the compiled link raises: a RuntimeError with args (kind, the backend's message).
LinkError = _module.LinkError if _module is not None else type("LinkError", (RuntimeError,), {})

ENV = "AFD_ONE_LINK"


def available() -> bool:
    return _module is not None and os.environ.get(ENV, "1") != "0"


def _usable(io: PeerIO | None) -> bool:
    return (io is not None and not io.in_order and available()
            and isinstance(io.group, dist.ProcessGroupGloo))


def _make(cls_name: str, io: PeerIO, *args):
    """A link over ``io``'s group, or None (the Python path) if it cannot be made."""
    try:
        return getattr(_module, cls_name)(io.group, *args)
    except Exception as e:  # noqa: BLE001 - the Python path serves, as if it were not built
        logger.warning("AFD: the compiled one-link path cannot serve this group (%s: %s); the "
                       "P2P connector runs its Python path", type(e).__name__, e)
        return None


def attention_link(io: PeerIO | None, dst: int, shape):
    """The compiled attention half of the link to global rank ``dst``, where it can serve."""
    if not _usable(io):
        return None
    return _make("AttentionLink", io, dst, shape.dtype, shape.hidden_size,
                 list(shape.moe_layers), shape.num_layers)


def ffn_link(io: PeerIO | None, src: int, shape):
    """The compiled FFN half of the link from global rank ``src``, where it can serve."""
    if not _usable(io):
        return None
    return _make("FFNLink", io, src, shape.dtype, shape.hidden_size, list(shape.moe_layers),
                 shape.max_num_tokens)


#: Each half's primitives on the path of every layer, and of a step's start (the plan, which
#: the step's first rows follow at once), by role.
PRIMITIVES = {"attention": ("send_attn_output", "recv_ffn_output", "begin_step"),
              "ffn": ("recv_layer", "send_ffn_output", "recv_step")}


def serve(half, link, failure, *context) -> None:
    """Have ``link`` answer ``half``'s primitives on a layer's path (``PRIMITIVES``): they
    become the link's methods, attributes of the instance, which call the class's own for every
    call the link refuses. ``failure(LinkError, *where)`` is the half's error for a failure on the wire;
    ``context`` what its link needs besides (``bind`` in csrc/one_link.cpp). The link holds the
    half's methods, and so the half, until the half's close drops it (``drop`` lets go of them:
    the garbage collector cannot see that cycle); ``unserve`` there undoes the attributes.

    A connector's methods in Python, even as thin as the compiled path leaves them (a check, the
    link's call, the answer's tuple), cost each layer's round trip 3-8 us at 1 token on the
    2-vCPU VM of ``benchmarks/transport.py``: one Python frame per primitive, run cold after
    every wait. Called straight, the link's methods ran layers 2-16 of a step at 1.00-1.09x raw
    Gloo where the connector's ran at 1.08-1.12x (paired steps, four runs). They are C functions
    taking their arguments by position (csrc/one_link.cpp ``entry``); a call by keyword goes to
    the class's method."""
    names = PRIMITIVES[half.role]
    link.bind(*context)
    link.bind_connector(half.timeouts, failure,
                        *[getattr(type(half), name).__get__(half) for name in names])
    for name in names:
        setattr(half, name, getattr(link, name))


def unserve(half) -> None:
    """The class's methods answer ``half``'s primitives again (the connector closes)."""
    for name in PRIMITIVES[half.role]:
        half.__dict__.pop(name, None)


def failure(net, e: LinkError, peer: int, what: tuple | str | None,
            timeout_s: float | None) -> Exception:
    """The AFD error for a failure the compiled link raised, worded as its connector's ``net``
    (its data PeerIO) words its own; ``net`` None: the connector closed meanwhile (from another
    thread), which ended the wait or its peer's."""
    kind, detail = e.args
    if net is None:
        return AFDPeerError(f"the connector closed while its compiled link was busy ({kind}: "
                            f"{first_line_of(detail)})")
    return net.data.failure(kind, peer, what, timeout_s, detail)
