"""Forming one AFD world: rendezvous, handshake, then the process groups.

Every connector goes through here, so the rules hold for all of them: the FFN rank 0 hosts the
rendezvous on the configured host; each rank claims its place (two processes claiming the same
rank is an error, not a silent mix-up); every rank publishes a fingerprint and compares every
other rank's with its own *before* any process group exists, so roles that do not belong together
refuse each other with one error naming the field and both values. The first refusal is left in
the store, so a rank that sees nothing wrong itself still stops with the reason, and the FFN rank 0
keeps the store up (at most ``REFUSAL_LINGER_S``) until every peer has seen it: a rank slower to
claim or compare must not find the store gone and stop without knowing why.

Attention ranks that step in lock (vLLM's DP ranks without ``async_dp``) also tell each other how
many forwards each has finished (``steps_done``): after a lost FFN role, one of them may have got
its step's last result and another not, and the FFN side's first step of the new world must pair
the second's re-run with an empty step of the first (``catch_up_steps``, afd_attention.session).

With an ``auth_token`` every hello carries an HMAC over the master's fresh session nonce and the
hello itself: a peer proves it holds the token without sending it, and a peer without it (or with
another) is refused before it can join any process group. The groups' own rendezvous entries (each
rank's address) are then signed with a key derived from the token and the nonce
(``transport.SignedStore``), so a host that reaches the store cannot redirect a rank after the
handshake either. Traffic is not encrypted.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from afd_common import __version__
from afd_common.transport.codec import WIRE_VERSION, decode_json, encode_json
from afd_common.config import AFDConfig
from afd_common.errors import (AFDError, AFDHandshakeError, AFDPeerError, AFDProtocolError,
                               AFDRendezvousClosingError, AFDTimeoutError)
from afd_common.transport.process_groups import (CONNECT_PROGRESS_EVERY_S, Rendezvous,
                                                 SignedStore, new_group)

logger = logging.getLogger("vllm.afd")

REFUSAL_KEY = "afd/refusal"
# The claims of the worlds this process left (closed). Finding one of them on a rendezvous means
# the store is such a world's, still up for a moment after its host went (a SIGTERMed FFN role
# shutting down): not another process, nor another world of this one, with the same rank.
_CLAIMS_LEFT: set[bytes] = set()
# The longest the FFN rank 0 waits for the peers to acknowledge a refusal before it closes the
# store: a peer that never comes, or never looks again, must not hold it.
REFUSAL_LINGER_S = 5.0


def sign(token: str, session: bytes, hello: dict[str, Any]) -> str:
    """HMAC-SHA256 of this session's nonce and the hello: proves the token, never sends it."""
    body = json.dumps(hello, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(token.encode(), b"afd-hello\0" + session + b"\0" + body,
                    hashlib.sha256).hexdigest()


class AFDWorld:
    """Ranks ``0..world_size-1`` of one AFD deployment, laid out by the connector.

    ``global_rank_of(role, local_rank)`` is the connector's layout (attention-first for P2P and
    CAMAsync, FFN-first for CAMP2p). Waiting for the peers to turn up (rendezvous, hellos) is
    bounded by ``connect_timeout_s`` only (none by default: roles start in any order, any time
    apart); once every rank said hello, forming the groups is bounded by ``timeout_s``.
    """

    def __init__(self, config: AFDConfig, local_rank: int, world_size: int,
                 global_rank_of: Callable[[str, int], int], fingerprint: dict[str, Any],
                 timeout_s: float, cancel: threading.Event | None = None,
                 steps_done: int | None = None):
        """``cancel`` set from another thread (the connector's ``close``) ends a wait for the
        peers at once, with AFDPeerError. ``steps_done``: a lock-step attention rank's finished
        forwards (None: nothing to line up)."""
        self.config = config
        self.world_size = world_size
        self.rank = global_rank_of(config.role, local_rank)
        self.timeout_s = timeout_s
        self.connect_timeout_s = config.extra.connect_timeout_s
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.steps_done = steps_done
        self._claim: bytes | None = None  # this rank's claim on the rendezvous, once made
        #: Empty steps this attention rank runs first in this world (see the module docstring).
        self.catch_up_steps = 0
        self._group_store: SignedStore | None = None
        self._roles = {global_rank_of("attention", a): ("attention", a)
                       for a in range(config.num_attention_ranks)}
        self._roles.update({global_rank_of("ffn", f): ("ffn", f)
                            for f in range(config.num_ffn_ranks)})
        self.what = f"AFD {config.role} rank {local_rank}"
        self.is_master = self.rank == global_rank_of("ffn", 0)
        self.rendezvous = Rendezvous(config.host, config.port, self.is_master, timeout_s,
                                     self.what, self.connect_timeout_s, cancel)
        try:
            if self.is_master:
                self.rendezvous.store.set("afd/nonce", secrets.token_hex(16))
            self._claim_rank()
            self._handshake(fingerprint)
        except BaseException:
            self.close()
            raise

    def describe(self, global_rank: int) -> str:
        role, local = self._roles.get(global_rank, ("?", global_rank))
        return f"{'FFN' if role == 'ffn' else role} rank {local} (global {global_rank})"

    def _claim_rank(self) -> None:
        store = self.rendezvous.store
        me = f"{os.getpid()}@{secrets.token_hex(4)}".encode()
        got = bytes(store.compare_set(f"afd/claim/{self.rank}", b"", me))
        if got == me:
            self._claim = me
            return
        if got in _CLAIMS_LEFT:
            raise AFDRendezvousClosingError(
                f"{self.what}: the rendezvous at {self.config.host}:{self.config.port} is still "
                "the last world's, which this process left; it is closing")
        raise AFDHandshakeError(f"{self.what}: {self.describe(self.rank)} is already taken by "
                                f"another process at {self.config.host}:{self.config.port}; "
                                "check each process's rank and num_*_ranks")

    def _handshake(self, fingerprint: dict[str, Any]) -> None:
        try:
            self._exchange_hellos(fingerprint)
        except (RuntimeError, dist.DistStoreError) as e:
            if isinstance(e, AFDError):
                raise
            raise AFDPeerError(f"{self.what}: lost the rendezvous at {self.config.host}:"
                               f"{self.config.port} during the handshake ({e}); the FFN role "
                               "may have refused this role: see its log") from None

    def _exchange_hellos(self, fingerprint: dict[str, Any]) -> None:
        store = self.rendezvous.store
        start = time.monotonic()
        self.rendezvous.wait_keys(["afd/nonce"], self.connect_timeout_s,
                                  f"{self.what}: rendezvous")
        session = bytes(store.get("afd/nonce"))
        hello = {"afd_version": __version__, "wire_version": WIRE_VERSION,
                 "role": self.config.role, "rank": self.rank, "fingerprint": fingerprint,
                 "steps_done": self.steps_done}
        token = self.config.extra.auth_token
        signed = dict(hello, mac=sign(token, session, hello) if token else None)
        if token:  # the groups' rendezvous entries, signed under a key only token holders have
            self._group_store = SignedStore(store, hmac.new(token.encode(), b"afd-groups\0"
                                                            + session, hashlib.sha256).digest())
        store.set(f"afd/hello/{self.rank}", encode_json(signed))
        others = [r for r in range(self.world_size) if r != self.rank]
        # Check each peer as soon as it says hello: one mismatched peer is refused at once, not
        # after waiting for ranks that a mismatched world size means will never come.
        unchecked = list(others)
        steps_done: dict[int, Any] = {}
        next_log = CONNECT_PROGRESS_EVERY_S
        limit = self.connect_timeout_s
        try:
            while unchecked:
                present = [r for r in unchecked if store.check([f"afd/hello/{r}"])]
                for r in present:
                    try:
                        peer = decode_json(bytes(store.get(f"afd/hello/{r}")))
                    except AFDProtocolError as e:
                        raise AFDHandshakeError(f"{self.what}: {self.describe(r)} sent a "
                                                f"malformed hello: {e}") from None
                    self._authenticate(r, token, session, peer)
                    self._compare(r, hello, peer)
                    if self._roles[r][0] == "attention":
                        steps_done[r] = peer.get("steps_done")
                    unchecked.remove(r)
                # After this rank's own checks, which explain a mismatch from its side: a peer's
                # refusal only stops it when it sees nothing wrong itself (or not yet).
                if store.check([REFUSAL_KEY]):
                    refusal = decode_json(bytes(store.get(REFUSAL_KEY)))
                    raise AFDHandshakeError(f"{self.what}: refused by {refusal.get('by')}: "
                                            f"{refusal.get('reason')}")
                if unchecked and not present:
                    self.rendezvous.check_cancelled(f"{self.what}: handshake")
                    waited = time.monotonic() - start
                    if limit is not None and waited > limit:
                        raise AFDTimeoutError(f"{self.what}: handshake: no hello from "
                                              f"{', '.join(map(self.describe, unchecked))} after "
                                              f"{limit:.0f} s (connect_timeout_s)")
                    if waited >= next_log:
                        logger.info("%s: waiting for %s to say hello (%.0f s)", self.what,
                                    ", ".join(map(self.describe, unchecked)), waited)
                        next_log += CONNECT_PROGRESS_EVERY_S
                    time.sleep(0.05)
            if self.config.role == "attention":
                steps_done[self.rank] = self.steps_done
            if any(n is not None for n in steps_done.values()):
                behind = self._furthest_behind(steps_done)
                if self.steps_done is not None:
                    self.catch_up_steps = self.steps_done - behind
        except AFDHandshakeError as e:
            self._leave_refusal(str(e))
            raise
        logger.info("%s: handshake with %d peers ok (%.1f s)", self.what, len(others),
                    time.monotonic() - start)

    def _furthest_behind(self, told: dict[int, Any]) -> int:
        """The fewest forwards any attention rank finished. Every rank, FFN ranks included,
        checks the counts the same way, so a bad one is refused on all sides whatever the order
        the hellos arrive in; a count is never trusted: lock-step ranks are at most one apart."""
        counts = {}
        for r, n in sorted(told.items()):
            if type(n) is not int or n < 0:
                raise AFDHandshakeError(f"{self.what}: {self.describe(r)} sent steps_done {n!r}: "
                                        "expected the count of its finished forwards (>= 0)")
            counts[r] = n
        behind, ahead = min(counts, key=counts.get), max(counts, key=counts.get)
        if counts[ahead] - counts[behind] > 1:
            raise AFDHandshakeError(
                f"{self.what}: attention ranks more than one forward apart: "
                f"{self.describe(ahead)} finished {counts[ahead]}, {self.describe(behind)} "
                f"{counts[behind]} (steps_done); lock-step DP ranks never are")
        return counts[behind]

    def _leave_refusal(self, message: str) -> None:
        """Tell the peers why the handshake stopped before this rank's store connection goes.

        Best effort: the refusal raised here matters more than the copy left for the others. The
        first refusal stays, so a rank stopping because of a peer's refusal only acknowledges it.
        """
        store = self.rendezvous.store
        try:
            reason = encode_json({"by": self.describe(self.rank),
                                  "reason": message.removeprefix(f"{self.what}: ")})
            store.compare_set(REFUSAL_KEY, b"", reason)
            store.set(f"afd/refusal_seen/{self.rank}", b"1")
            if self.is_master:
                self._linger(store)
        except (RuntimeError, ValueError) as e:
            logger.debug("%s: could not leave the refusal for the peers: %s", self.what, e)

    def _linger(self, store: dist.Store) -> None:
        """A peer may still be on its way to its claim, its hello or its comparing: closing the
        store under it would leave it a bare store error. So wait for every one's
        acknowledgement, boundedly: also for a peer that has not claimed its place yet (one
        started a moment later than the refused one met a closed store at its claim)."""
        end = time.monotonic() + REFUSAL_LINGER_S
        others = [r for r in range(self.world_size) if r != self.rank]
        while time.monotonic() < end:
            if all(store.check([f"afd/refusal_seen/{r}"]) for r in others):
                return
            time.sleep(0.05)
        logger.info("%s: closing the rendezvous; not every peer read the refusal within %.0f s",
                    self.what, REFUSAL_LINGER_S)

    def _authenticate(self, r: int, token: str | None, session: bytes,
                      peer: dict[str, Any]) -> None:
        mac = peer.pop("mac", None)
        if token is None and mac is None:
            return
        who = self.describe(r)
        if token is None:
            raise AFDHandshakeError(f"{self.what}: refusing {who}: it authenticates with an "
                                    "auth_token and this role has none (set "
                                    "connector_extra_config.auth_token or AFD_AUTH_TOKEN)")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, sign(token, session, peer)):
            raise AFDHandshakeError(f"{self.what}: refusing {who}: authentication failed "
                                    "(missing or different auth_token)")

    def _compare(self, r: int, ours: dict[str, Any], theirs: dict[str, Any]) -> None:
        peer = self.describe(r)
        for key in ("wire_version", "afd_version"):
            if theirs.get(key) != ours[key]:
                raise AFDHandshakeError(f"{self.what}: {key} differs: ours {ours[key]!r}, "
                                        f"{peer} has {theirs.get(key)!r}")
        expected_role = self._roles[r][0]
        if theirs.get("role") != expected_role or theirs.get("rank") != r:
            raise AFDHandshakeError(f"{self.what}: global rank {r} should be {expected_role}, "
                                    f"peer says role {theirs.get('role')!r} rank "
                                    f"{theirs.get('rank')!r}")
        fp_ours, fp_theirs = ours["fingerprint"], theirs.get("fingerprint")
        if not isinstance(fp_theirs, dict):
            raise AFDHandshakeError(f"{self.what}: {peer} sent no fingerprint")
        # In fingerprint order: the most telling difference (layer count before layer list) first.
        for key in list(fp_ours) + [k for k in fp_theirs if k not in fp_ours]:
            if fp_ours.get(key) != fp_theirs.get(key):
                raise AFDHandshakeError(
                    f"{self.what}: refusing {peer}: {key!r} differs: this {self.config.role} "
                    f"role has {fp_ours.get(key)!r}, the peer has {fp_theirs.get(key)!r}")

    def group(self, name: str, backend: str) -> dist.ProcessGroup:
        """A process group over the whole world, created once per name."""
        if name not in self.groups:
            store = self._group_store
            self.groups[name] = new_group(backend, self.rendezvous.store if store is None
                                          else store, f"afd/pg/{name}", self.rank,
                                          self.world_size, self.timeout_s, self.config.host)
        return self.groups[name]

    def close(self) -> None:
        if self._claim is not None:
            _CLAIMS_LEFT.add(self._claim)
        for pg in self.groups.values():
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort; the process may be going away
                pass
        self.groups.clear()
        self._group_store = None
        self.rendezvous_close()

    def rendezvous_close(self) -> None:
        rv = getattr(self, "rendezvous", None)
        if rv is not None:
            rv.close()


def open_world(connector, global_rank_of: Callable[[str, int], int] | None = None) -> AFDWorld:
    """The world of either half of ``connector`` (``global_rank_of`` defaults to its topology's
    layout). An attention half's ``steps_done`` goes out in its hello, and the steps it must
    catch up come back on it (``catch_up_steps``), before any group forms."""
    cfg, topo = connector.config, connector.topology
    world = AFDWorld(cfg, connector.local_rank, topo.world_size,
                     global_rank_of or topo.global_rank, connector.fingerprint(),
                     connector.timeouts.first_step_s, connector.closing,
                     steps_done=getattr(connector, "steps_done", None))
    if connector.role == "attention":
        connector.catch_up_steps = world.catch_up_steps
    return world
