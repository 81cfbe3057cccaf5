"""Handshake and authentication between spawned ranks: refusals name the field, both sides stop."""

import multiprocessing as mp
import queue
import threading
import time
import traceback

import pytest

from afd_common.tools.launch import free_port
from afd_common.tools.selftest import Spec, run_world
from op_world import join_or_kill

pytestmark = pytest.mark.multiproc


def errors(results):
    return {(r.role, r.rank): (r.status, str(r.detail)) for r in results}


@pytest.mark.parametrize("changes,field", [
    ({"hidden_size": 32}, "hidden_size"),
    ({"num_layers": 3}, "num_layers"),
    ({"stages": 1}, "num_micro_batches"),
    ({"dtype": "bfloat16"}, "dtype"),
], ids=["hidden_size", "num_layers", "micro_batches", "dtype"])
def test_mismatch_refused_by_both_sides(changes, field):
    spec = Spec(1, 1, steps=1, timeout_s=20, ffn_changes=changes)
    results = run_world(spec, deadline_s=60)
    for key, (status, detail) in errors(results).items():
        assert status == "error", (key, detail)
        assert "AFDHandshakeError" in detail and f"'{field}' differs" in detail, detail
        assert all(r.seconds < 30 for r in results)


@pytest.mark.parametrize("ffn_changes,field", [
    ({"sharded": True}, "expert_placement"),
    ({"num_experts": 9}, "num_experts"),
], ids=["placement", "num_experts"])
def test_placement_mismatch_refused_by_both_sides(ffn_changes, field):
    """2 FFN ranks: the attention role replicated, the FFN role sharded (or another expert
    count): refused before any tensor moves, naming the field."""
    spec = Spec(1, 2, steps=1, gate_on_attention=True, timeout_s=15, ffn_changes=ffn_changes)
    results = run_world(spec, deadline_s=60)
    for key, (status, detail) in errors(results).items():
        assert status == "error", (key, detail)
        # FFN rank 1 may reach the rendezvous only as FFN rank 0, having refused, closes it: it
        # then fails on its own bound or finds the store gone, not with the field (a rank that
        # claimed its place in time is told).
        late = ("no AFD rendezvous" in detail or "lost the rendezvous" in detail)
        if key != ("ffn", 1) or not late:
            assert "AFDHandshakeError" in detail and f"'{field}' differs" in detail, detail


def test_wrong_auth_token_refused_and_never_logged():
    spec = Spec(1, 1, steps=1, timeout_s=20, extra={"auth_token": "right-token-123"},
                ffn_changes={"extra": {"auth_token": "wrong-token-456"}})
    for key, (status, detail) in errors(run_world(spec, deadline_s=60)).items():
        assert status == "error" and "authentication failed" in detail, (key, detail)
        assert "token-123" not in detail and "token-456" not in detail


def test_missing_auth_token_refused():
    spec = Spec(1, 1, steps=1, timeout_s=20, extra={"auth_token": "right-token-123"},
                ffn_changes={"extra": {}})
    got = errors(run_world(spec, deadline_s=60))
    assert "authentication failed" in got[("attention", 0)][1]
    assert "this role has none" in got[("ffn", 0)][1]


def test_right_auth_token_works():
    spec = Spec(2, 1, steps=2, timeout_s=20, extra={"auth_token": "shared-secret"})
    results = run_world(spec, deadline_s=60)
    assert all(r.status == "ok" for r in results), errors(results)


def _stalling_rank(role: str, spec: Spec, stall_s: float, tamper: bool, linger_s: float | None,
                   q) -> None:
    """One rank forming an ``AFDWorld`` directly, no connector. With ``stall_s`` it stops that long
    after publishing its hello, before reading anything: a rank descheduled on a loaded machine.
    With ``tamper`` its hello is altered on the way (after signing), which only its peers notice."""
    from afd_common.transport import world
    from afd_common.transport.codec import decode_json, encode_json
    from afd_common.topology import Topology

    hello_at = []

    class HelloSeam:
        def __init__(self, store):
            self._store = store

        def __getattr__(self, name):
            return getattr(self._store, name)

        def set(self, key, value):
            if key.startswith("afd/hello/") and tamper:
                hello = decode_json(value)
                hello["fingerprint"]["num_ffn_ranks"] += 1
                value = encode_json(hello)
            self._store.set(key, value)
            if key.startswith("afd/hello/"):
                hello_at.append(time.monotonic())
                time.sleep(stall_s)

    class StallingRendezvous(world.Rendezvous):
        def __init__(self, *args):
            super().__init__(*args)
            self.store = HelloSeam(self.store)

    world.Rendezvous = StallingRendezvous
    if linger_s is not None:
        world.REFUSAL_LINGER_S = linger_s
    config = spec.config(role)
    topo = Topology(config.num_attention_ranks, config.num_ffn_ranks)
    fingerprint = {"num_attention_ranks": config.num_attention_ranks,
                   "num_ffn_ranks": config.num_ffn_ranks}
    try:
        world.AFDWorld(config, 0, topo.world_size, topo.global_rank, fingerprint,
                       spec.timeout_s).close()
        q.put((role, "ok", "", hello_at, time.monotonic()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put((role, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", hello_at,
               time.monotonic()))


def run_stalled_pair(ffn_ranks: int, stall_s: float, tamper: bool = False,
                     linger_s: float | None = None, extra: dict | None = None,
                     deadline_s: float = 60.0) -> dict:
    """The FFN rank 0 (of ``ffn_ranks``) and an attention rank that expects one FFN rank and
    stalls after its hello. ``{role: (status, detail, hello_at, end)}``, stamped with
    ``time.monotonic()``: one clock for every process on the machine."""
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_stalling_rank, daemon=True,
                         args=(role, Spec(1, n, timeout_s=20, port=port, extra=extra or {}),
                               stall, tamper and role == "attention", linger, q))
             for role, n, stall, linger in (("ffn", ffn_ranks, 0, linger_s),
                                            ("attention", 1, stall_s, None))]
    for p in procs:
        p.start()
    got = {}
    end = time.monotonic() + deadline_s
    try:
        while len(got) < 2 and time.monotonic() < end:
            try:
                role, *result = q.get(timeout=0.5)
                got[role] = tuple(result)
            except queue.Empty:
                pass
    finally:
        join_or_kill(procs)
    assert set(got) == {"ffn", "attention"}, f"no result (hung or died): {got}"
    return got


def test_refusal_reaches_a_peer_slower_than_the_master():
    # The FFN rank 0 refuses the attention rank's hello at once; the attention rank reads nothing
    # for 2 s after saying hello. It must still find the store and name the field, not stop with
    # "lost the rendezvous" (the race a loaded CI machine lost).
    got = run_stalled_pair(ffn_ranks=2, stall_s=2.0)
    status, detail, (hello_at,), done = got["attention"]
    assert status == "error" and "AFDHandshakeError" in detail, detail
    assert "'num_ffn_ranks' differs" in detail and "lost the rendezvous" not in detail, detail
    status, detail, _, master_done = got["ffn"]
    assert status == "error" and "'num_ffn_ranks' differs" in detail, detail
    # The master kept the store until the slow rank had looked, and within its linger bound.
    assert 2.0 <= master_done - hello_at < 5.0 + 2.0
    assert done - hello_at < 2.0 + 5.0


def test_peer_that_sees_nothing_wrong_stops_with_the_refusal():
    # The attention rank's hello is altered after signing: only the FFN rank 0 can tell. The
    # attention rank, which finds the FFN hello fine, must stop with the FFN rank's reason.
    got = run_stalled_pair(ffn_ranks=1, stall_s=1.0, tamper=True,
                           extra={"auth_token": "shared-secret"})
    status, detail, _, _ = got["attention"]
    assert status == "error" and "AFDHandshakeError" in detail, detail
    assert "refused by FFN rank 0 (global 1): refusing attention rank 0 (global 0): " \
           "authentication failed" in detail, detail
    status, detail, _, _ = got["ffn"]
    assert status == "error" and "authentication failed" in detail, detail


def test_master_lingers_only_a_bounded_time_for_a_peer_that_never_reads():
    got = run_stalled_pair(ffn_ranks=2, stall_s=4.0, linger_s=0.5)
    _, _, (hello_at,), done = got["attention"]
    status, detail, _, master_done = got["ffn"]
    assert status == "error" and "'num_ffn_ranks' differs" in detail, detail
    # Gone before the stalled rank even looked again: it did not wait for that acknowledgement.
    assert master_done < hello_at + 4.0 <= done


def test_gloo_binds_the_interfaces_gloo_socket_ifname_names(monkeypatch):
    """Gloo's own default device resolves the hostname (often to 127.0.0.1): with
    GLOO_SOCKET_IFNAME set, the AFD groups bind exactly the named interfaces, as torch's do."""
    from afd_common.transport.process_groups import gloo_devices

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,lo")
    assert len(gloo_devices("10.0.0.2")) == 2
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "afdnosuchif0")
    with pytest.raises(RuntimeError, match="afdnosuchif0"):
        gloo_devices("10.0.0.2")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert len(gloo_devices("127.0.0.1")) == 1


def test_signed_store_refuses_entries_no_authenticated_rank_wrote():
    """With an auth_token the groups' rendezvous entries are signed: a raw write (a process that
    only reaches the port), an entry signed under another key (another token or session) and a
    valid entry copied under another name are all refused."""
    import torch.distributed as dist

    from afd_common.errors import AFDPeerError
    from afd_common.transport.process_groups import SignedStore

    inner = dist.HashStore()
    ours, other = SignedStore(inner, b"this session"), SignedStore(inner, b"another")
    ours.set("rank/0", b"10.0.0.1:4000")
    assert ours.get("rank/0") == b"10.0.0.1:4000"
    inner.set("rank/0", b"10.6.6.6:4000")
    with pytest.raises(AFDPeerError, match="'rank/0' was not written by an authenticated"):
        ours.get("rank/0")
    other.set("rank/0", b"10.6.6.6:4000")
    with pytest.raises(AFDPeerError, match="'rank/0'"):
        ours.get("rank/0")
    ours.set("rank/1", b"10.0.0.2:4000")
    inner.set("rank/0", inner.get("rank/1"))
    with pytest.raises(AFDPeerError, match="'rank/0'"):
        ours.get("rank/0")


def test_a_forged_group_entry_cannot_redirect_a_rank():
    """During group formation a process without the key overwrites rank 0's entry in the
    rendezvous store: rank 1 refuses to connect where it points, with the reason."""
    import datetime
    import threading

    import torch.distributed as dist

    from afd_common.errors import AFDPeerError
    from afd_common.transport.process_groups import SignedStore, new_group

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    errors = []
    signed = [SignedStore(master, b"k")]

    def rank0():
        try:
            new_group("gloo", signed[0], "afd/pg/data", 0, 2, 3.0, "127.0.0.1")
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=rank0)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while not (keys := [k for k in master.list_keys() if k.startswith("afd/pg/data")]):
            assert time.monotonic() < deadline, "rank 0 never published its entry"
            time.sleep(0.01)
        attacker = dist.TCPStore("127.0.0.1", port, 2, False,
                                 timeout=datetime.timedelta(seconds=10))
        attacker.set(keys[0], b"\x01" * 64)
        signed.append(SignedStore(attacker, b"k"))  # rank 1's view, through the same port
        with pytest.raises(AFDPeerError, match="not written by an authenticated AFD rank"):
            new_group("gloo", signed[1], "afd/pg/data", 1, 2, 3.0, "127.0.0.1")
    finally:
        t.join(timeout=30)
    # Rank 0 is not left hanging. Whether it reports the failure depends on timing: rank 1
    # published its own (genuine) entry before refusing, and a connect that lands on its socket
    # before the socket closes lets rank 0 finish forming a group it will then find dead.
    assert not t.is_alive(), "rank 0 still forming the group after 30 s"
    print(f"rank 0: {errors or 'formed the group before rank 1 closed'}")


def _world_in_thread(role: str, spec: Spec, connect_timeout_s: float | None, out: dict,
                     formed=None):
    """One rank's AFDWorld formed in a thread; ``out[role]`` = "ok" or the error. With
    ``formed`` (a barrier) the world stays open until every rank has formed its own: the FFN
    rank hosts the store, and closing it at once could cut a peer still reading its hello."""
    import dataclasses
    import threading

    from afd_common.transport import world
    from afd_common.topology import Topology

    config = spec.config(role)
    config = dataclasses.replace(config, extra=dataclasses.replace(
        config.extra, connect_timeout_s=connect_timeout_s))
    topo = Topology(1, 1)

    def run():
        try:
            w = world.AFDWorld(config, 0, topo.world_size, topo.global_rank, {"f": 1},
                               spec.timeout_s)
            out[role] = "ok"
            if formed is not None:
                formed.wait()
            w.close()
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[role] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("first", ["attention", "ffn"])
def test_a_role_waits_for_its_peer_longer_than_any_step_timeout(first):
    """Without connect_timeout_s the first role to start waits as long as it takes (here 4x
    the step timeouts) and the world forms when the other turns up."""
    import threading

    spec, out = Spec(1, 1, timeout_s=1, port=free_port()), {}
    formed = threading.Barrier(2, timeout=30)
    threads = [_world_in_thread(first, spec, None, out, formed)]
    time.sleep(4)
    assert out == {}, out
    threads.append(_world_in_thread({"attention": "ffn", "ffn": "attention"}[first], spec, None,
                                    out, formed))
    for t in threads:
        t.join(30)
    assert out == {"attention": "ok", "ffn": "ok"}


@pytest.mark.parametrize("role", ["attention", "ffn"])
def test_connect_timeout_s_bounds_the_wait_for_a_peer_that_never_comes(role):
    spec, out = Spec(1, 1, timeout_s=30, port=free_port()), {}
    start = time.monotonic()
    _world_in_thread(role, spec, 1.5, out).join(30)
    took = time.monotonic() - start
    assert "AFDTimeoutError" in out[role] and "connect_timeout_s" in out[role], out
    assert 1.5 <= took < 10, took


def _form_2a1f(steps_done: tuple) -> dict:
    """A 2A1F world formed in threads, the attention ranks telling ``steps_done``:
    ``{(role, rank): catch_up_steps or the error}``."""
    import threading

    from afd_common.transport import world
    from afd_common.topology import Topology

    spec, out = Spec(2, 1, timeout_s=20, port=free_port()), {}
    topo = Topology(2, 1)
    formed = threading.Barrier(3, timeout=30)  # the FFN rank 0's store outlives every handshake

    def run(role, rank, done):
        try:
            w = world.AFDWorld(spec.config(role), rank, topo.world_size, topo.global_rank,
                               {"f": 1}, spec.timeout_s, steps_done=done)
            out[role, rank] = w.catch_up_steps
            formed.wait()
            w.close()
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[role, rank] = f"{type(e).__name__}: {e}"
    threads = [threading.Thread(target=run, args=args, daemon=True)
               for args in [("ffn", 0, None), ("attention", 0, steps_done[0]),
                            ("attention", 1, steps_done[1])]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_lock_step_attention_ranks_learn_who_must_catch_up_a_step():
    """After a loss between two attention ranks' last results of a step, the one that finished
    it runs one empty step first (afd_attention.session): the handshake says which."""
    assert _form_2a1f((8, 7)) == {("ffn", 0): 0, ("attention", 0): 1, ("attention", 1): 0}
    assert _form_2a1f((5, 5)) == {("ffn", 0): 0, ("attention", 0): 0, ("attention", 1): 0}


@pytest.mark.parametrize("steps_done,says", [
    ((7, 9), "more than one forward apart: attention rank 1 (global 1) finished 9"),
    ((7, -1), "attention rank 1 (global 1) sent steps_done -1"),
])
def test_a_count_of_finished_forwards_is_checked_not_trusted(steps_done, says):
    out = _form_2a1f(steps_done)
    assert "AFDHandshakeError" in out["attention", 0] and says in out["attention", 0], out
    # The FFN rank checks the counts itself: it refuses whichever order the hellos arrive in.
    assert "AFDHandshakeError" in out["ffn", 0] and says in out["ffn", 0], out


def test_a_rank_that_finds_its_own_claim_is_told_the_last_world_is_closing():
    """A SIGTERMed FFN role's rendezvous can outlive it by a moment; an attention rank riding
    through the loss may reach it first and find its own claim of the world it left. That is
    worth another try (AFDRendezvousClosingError, which the ride-through retries), unlike a
    claim another process holds: two processes given one rank, a handshake error."""
    from afd_common.errors import AFDHandshakeError, AFDPeerError, AFDRendezvousClosingError
    from afd_common.topology import Topology
    from afd_common.transport.process_groups import Rendezvous
    from afd_common.transport.world import AFDWorld

    spec = Spec(3, 1, timeout_s=1, port=free_port())
    topo = Topology(3, 1)
    old = Rendezvous("127.0.0.1", spec.port, True, 5, "the last world's FFN rank 0")

    def form(rank: int) -> None:
        AFDWorld(spec.config("attention"), rank, topo.world_size, topo.global_rank, {}, 1)

    with pytest.raises(AFDPeerError) as first:  # claimed, then no peer said hello: left
        form(0)
    assert not isinstance(first.value, AFDRendezvousClosingError)
    with pytest.raises(AFDRendezvousClosingError, match="still the last world's"):
        form(0)
    # A world this process has not left (it waits for its peers) holds its claim.
    waiting = threading.Thread(target=lambda: pytest.raises(AFDPeerError, form, 1))
    waiting.start()
    time.sleep(0.3)
    with pytest.raises(AFDHandshakeError, match="already taken by another process"):
        form(1)
    waiting.join()
    old.store.set(f"afd/claim/{topo.global_rank('attention', 2)}", b"1@another")
    with pytest.raises(AFDHandshakeError, match="already taken by another process"):
        form(2)
