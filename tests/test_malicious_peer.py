"""A peer that passed the handshake and then lies: nothing it says about sizes is trusted.

* Fuzz (hypothesis, 2,000 frames each): the FFN side's step-frame path, exactly as a received
  frame goes -- the control plane's receive and decode, then the connector's check of the counts
  against this role's own max_num_tokens -- refuses (afd's own errors, naming the peer) or
  yields a plan in which no attention rank brings more than this role's limit, so no receive
  is sized by the peer.
* Over a real connection (spawned ranks, Gloo): a fake attention rank announces 2^40 - 1 rows,
  routes a row to an expert id past the model's, or (CAMAsync) names a layer the model does not
  have. The FFN rank refuses each with one clear error, and its peak memory stays that of a
  small run (no allocation was sized by the lie).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import queue
import resource
import traceback

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_common.transport import codec
from afd_common.transport.control_plane import GlooControlPlane
from afd_common.errors import AFDPeerError, AFDProtocolError
from afd_common.metadata import MAX_STAGES, StepKind, StepMetadata
from afd_common.registry import resolve_connector
from afd_common.tools.launch import free_port
from afd_common.tools.selftest import Spec, ffn_rank
from op_world import join_or_kill

MAX_TOKENS = 8192  # this FFN role's max_num_tokens (the default shape of a Spec)


class FramesIO:
    """The control plane's receive side, handing out given frames as if they came off the wire."""

    def __init__(self, frames: dict[int, bytes]):
        self.frames = frames

    def irecv(self, tensor, src, tag, what):
        raw = self.frames[src][:tensor.numel()]
        tensor.zero_()
        tensor[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else 0
        return tensor

    def wait(self, pending, timeout_s):
        return pending


def ffn_connector(A: int, F: int, sharded: bool):
    spec = Spec(A, F, gate_on_attention=True, sharded=sharded, port=1)  # never connects
    conn = resolve_connector("P2pAFDConnector", "ffn")(spec.config("ffn"), 0, spec.shape())
    assert conn.shape.max_num_tokens == MAX_TOKENS
    return conn


counts = st.one_of(st.integers(0, MAX_TOKENS), st.integers(0, codec.MAX_TOKENS - 1),
                   st.sampled_from([MAX_TOKENS + 1, 2**31, 2**40 - 1]))
steps = st.builds(lambda step, tokens: StepMetadata(step, StepKind.RUN, tuple(tokens)),
                  st.integers(0, 2**40), st.lists(counts, min_size=1, max_size=MAX_STAGES))


@st.composite
def frames(draw):
    """A frame as a malicious peer might send it: valid with any counts, mutated, truncated
    (the rest of the fixed-size slot is zeros) or noise."""
    kind = draw(st.sampled_from(["valid", "mutated", "truncated", "noise"]))
    if kind == "noise":
        return draw(st.binary(max_size=codec.STEP_FRAME_BYTES))
    frame = bytearray(codec.encode_step(draw(steps)))
    if kind == "truncated":
        return bytes(frame[:draw(st.integers(0, len(frame) - 1))])
    if kind == "mutated":
        for _ in range(draw(st.integers(1, 6))):
            frame[draw(st.integers(0, len(frame) - 1))] = draw(st.integers(0, 255))
    return bytes(frame)


@functools.cache
def _fuzzed_connector():
    """One connector for every example (building one takes ~30 ms: a minute over 2,000);
    ``_on_step`` keeps nothing from an earlier plan but the plan it replaces."""
    return ffn_connector(2, 1, False)


@settings(max_examples=2000, deadline=None)
@given(data=st.data())
def test_any_step_frame_is_refused_or_fits_this_roles_limit(data):
    """Two attention ranks feed this FFN rank (each step: two frames, 4,000 in all)."""
    A = 2
    conn = _fuzzed_connector()
    conn._plan = conn._sources = None  # nothing left from the last example
    peers = {a: a for a in range(A)}  # global rank -> attention rank (P2P: attention first)
    sent = {a: data.draw(frames()) for a in peers}
    control = GlooControlPlane(FramesIO(sent), peers, "ffn", 1.0)
    try:
        plan = control.recv_step(1.0)
        conn._on_step(plan)
    except (AFDPeerError, AFDProtocolError) as e:
        assert "attention" in str(e) or "global rank" in str(e), e
        return
    # What every receive of the step is sized by: (attention rank, rows) per stage. Each
    # attention rank may honestly bring up to max_num_tokens (A of them feed one FFN rank).
    for stage, sources in enumerate(conn._sources):
        assert all(rows <= MAX_TOKENS for _, rows in sources), (stage, sources, plan)


# --- Over a real connection ---------------------------------------------------------------------

def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _ffn_entry(spec: Spec, q) -> None:
    torch.set_num_threads(1)
    try:
        ffn_rank(spec, 0)
        q.put(("ffn", "ok", "", _peak_rss_mib()))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put(("ffn", "error", f"{type(e).__name__}: {e}", _peak_rss_mib()))


def _liar_entry(spec: Spec, attack: str, q) -> None:
    """A real attention connector (it passes the handshake), then one lie."""
    torch.set_num_threads(1)
    try:
        conn = resolve_connector(spec.connector, "attention")(spec.config("attention"), 0,
                                                             spec.shape())
        with conn:
            x = torch.ones(2, spec.hidden_size)
            ids = torch.zeros(2, spec.top_k, dtype=torch.int32)
            w = torch.full((2, spec.top_k), 0.5)
            pending = None
            if attack == "huge_step":
                conn.control_plane.send_step(StepMetadata(0, StepKind.RUN, (2**40 - 1,)))
            elif attack == "expert_id":
                conn.begin_step(StepMetadata(0, StepKind.RUN, (2,)))
                pending = conn.send_attn_output(x, _call(0), ids + spec.num_experts + 5, w)
            elif attack == "layer":  # CAMAsync: the layer index travels in the header
                conn.begin_step(StepMetadata(0, StepKind.RUN, (2,)))
                conn._dispatch(x, ids, 0, 999)
            # Stay until the FFN rank has refused (its end closes the connection).
            try:
                if pending is not None:
                    conn.recv_ffn_output(pending)
            except Exception:  # noqa: BLE001 - expected: the peer refused and left
                pass
        q.put(("attention", "ok", "", _peak_rss_mib()))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put(("attention", "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}",
               _peak_rss_mib()))


def _call(layer: int):
    from afd_common.metadata import LayerCall
    return LayerCall(layer, 0)


ATTACKS = [("P2pAFDConnector", "huge_step", "announced 1099511627775 tokens"),
           ("P2pAFDConnector", "expert_id", "routes to expert id 13, outside [0, 8)"),
           ("CAMP2pAFDConnector", "huge_step", "announced 1099511627775 tokens"),
           ("CAMAsyncAFDConnector", "layer",
            "attention rank 0: layer index 999 is not an MoE layer")]


@pytest.mark.multiproc
@pytest.mark.parametrize("connector,attack,says", ATTACKS,
                         ids=[f"{c}-{a}" for c, a, _ in ATTACKS])
def test_a_lying_peer_is_refused_with_a_clear_error_and_no_large_allocation(connector, attack,
                                                                            says):
    spec = Spec(1, 1, connector=connector, steps=1, stages=1, gate_on_attention=True,
                timeout_s=20, port=free_port())
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # The FFN rank's own baseline: the same process serving one honest step of this shape.
    procs = [ctx.Process(target=_ffn_entry, args=(spec, q), daemon=True),
             ctx.Process(target=_liar_entry, args=(spec, attack, q), daemon=True)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < 2:
            role, status, detail, peak = q.get(timeout=60)
            got[role] = (status, detail, peak)
    except queue.Empty:
        pass
    finally:
        join_or_kill(procs)
    assert "ffn" in got, f"the FFN rank neither refused nor ended: {got}"
    status, detail, peak = got["ffn"]
    print(f"{connector} {attack}: FFN rank {status}: {detail.splitlines()[0] if detail else ''} "
          f"(peak RSS {peak:.0f} MiB)")
    assert status == "error" and says in detail, detail
    # A spawned rank with torch and the connector loaded peaks at ~400-600 MiB; 2^40 rows of
    # 64 floats would be 256 TiB, and even the 13th expert's weights are not there to touch.
    assert peak < 1500, peak

