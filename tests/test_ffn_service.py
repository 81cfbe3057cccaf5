"""The FFN role as a service: one FFN process serves attention world after attention world --
stopped, killed mid-step, or refused at the handshake -- and each new one gets exact results.

The FFN side is ``afd_ffn.service.FFNService`` (what the FFN worker runs) in a spawned process;
each attention world is a spawned ``afd-selftest`` attention rank that checks every result.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from dataclasses import replace

import pytest

from afd_common.tools.launch import free_port
from afd_common.tools.selftest import Spec, expected, expected_async
from afd_common.tools.selftest import _entry as selftest_rank
from op_world import join_or_kill

pytestmark = pytest.mark.multiproc


def _compute_for(spec: Spec, rank: int):
    """What afd-selftest's FFN ranks compute (sharded: this rank's experts' share only)."""
    owners = spec.shape().placement.owner_table if spec.sharded else None

    def compute(item):
        if spec.connector == "CAMAsyncAFDConnector":  # rows are (token, expert) pairs
            return item.hidden_states * (item.layer_idx + 1) + item.meta.stage \
                + item.topk_ids.to(item.hidden_states.dtype)
        if owners is None:
            return expected(item.hidden_states, item.layer_idx, item.meta.stage, item.topk_ids,
                            item.topk_weights)
        return expected_async(item.hidden_states, item.layer_idx, item.meta.stage,
                              item.topk_ids, item.topk_weights,
                              owners[item.topk_ids.long()] == rank)
    return compute


def _ffn_service(spec: Spec, rank: int, commands, replies) -> None:
    import torch

    from afd_ffn.service import FFNService

    torch.set_num_threads(1)
    service = FFNService(spec.config("ffn"), rank, spec.shape(), _compute_for(spec, rank), "cpu")
    service.start()
    while True:
        command = commands.get()
        if command == "stop":
            service.stop()
            replies.put(("stopped", service._thread.is_alive()))
            return
        replies.put(service.status())


class Service:
    def __init__(self, spec: Spec, ranks: int):
        ctx = mp.get_context("spawn")
        self.links = [(ctx.Queue(), ctx.Queue()) for _ in range(ranks)]
        self.procs = [ctx.Process(target=_ffn_service, args=(spec, r, *q), daemon=True)
                      for r, q in enumerate(self.links)]
        for p in self.procs:
            p.start()

    def status(self) -> list[dict]:
        for commands, _ in self.links:
            commands.put("status")
        return [replies.get(timeout=30) for _, replies in self.links]

    def wait_for(self, predicate, timeout_s: float = 60) -> list[dict]:
        end = time.monotonic() + timeout_s
        while True:
            states = self.status()
            if all(predicate(s) for s in states) or time.monotonic() > end:
                return states
            time.sleep(0.2)


def attention_world(spec: Spec, deadline_s: float = 60, kill_after=None) -> list:
    """Run every attention rank of ``spec``; [(status, detail)] by rank. ``kill_after()``:
    SIGKILL the ranks once it returns True."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=selftest_rank, args=("attention", spec, a, q), daemon=True)
             for a in range(spec.num_attention_ranks)]
    for p in procs:
        p.start()
    if kill_after is not None:
        end = time.monotonic() + deadline_s
        while not kill_after() and time.monotonic() < end:
            time.sleep(0.1)
        for p in procs:
            p.kill()
        join_or_kill(procs)
        return [("killed", "")]
    got = []
    try:
        while len(got) < len(procs):
            _, rank, status, detail = q.get(timeout=deadline_s)
            got.append((status, detail))
    except queue.Empty:
        got.append(("hung", ""))
    finally:
        join_or_kill(procs)
    return got


@pytest.mark.parametrize("connector,stages", [("P2pAFDConnector", 2),
                                              ("CAMAsyncAFDConnector", 1)])
def test_one_ffn_role_serves_world_after_world(connector, stages):
    """Two FFN ranks with their share of the experts each, two attention ranks."""
    A = F = 2
    spec = Spec(A, F, connector=connector, steps=3, num_layers=3, stages=stages,
                gate_on_attention=True, sharded=True, timeout_s=20, port=free_port())
    service = Service(spec, F)
    try:
        # 1. An attention world that runs and stops: the FFN role waits for the next one.
        first = attention_world(spec)
        assert all(s == "ok" for s, _ in first), first
        states = service.wait_for(lambda s: s["state"] == "waiting" and s["attention_worlds"])
        assert all(s["healthy"] and s["error"] is None for s in states), states
        # 2. One killed mid-run (SIGKILL, nothing said): the FFN role names the loss and waits.
        long = replace(spec, steps=10_000)
        attention_world(long, kill_after=lambda: all(
            s["state"] == "serving" and s["steps"] > 3 for s in service.status()))
        states = service.wait_for(lambda s: s["state"] == "waiting" and s["attention_worlds"] == 2)
        assert all(s["state"] == "waiting" and s["error"] for s in states), str(states)
        # 3. One that does not belong (another hidden size): refused, the FFN role stays.
        other = attention_world(replace(spec, hidden_size=32))
        assert all(s == "error" and "hidden_size" in d for s, d in other), other
        # 4. And the next right one gets exact results (checked row by row by the rank).
        last = attention_world(spec)
        assert all(s == "ok" for s, _ in last), last
        states = service.wait_for(lambda s: s["attention_worlds"] == 3 and s["state"] == "waiting")
        print(f"FFN ranks after four attention worlds: {states}")
        assert all(s["attention_worlds"] == 3 and s["healthy"] for s in states), states
    finally:
        for commands, _ in service.links:
            commands.put("stop")
        join_or_kill(service.procs, timeout_s=15)


def _riding_attention_rank(spec: Spec, rank: int, steps_after: int, q) -> None:
    """An attention rank as the attention worker runs it (``AttentionSession``), checking every
    result row by row, until it served ``steps_after`` steps on a second FFN world."""
    import logging
    import traceback

    import torch

    from afd_attention.session import AttentionSession
    from afd_common.registry import resolve_connector
    from afd_common.tools.selftest import expected, expected_async, make_inputs, tokens

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    try:
        config, shape = spec.config("attention"), spec.shape()
        cls = resolve_connector(spec.connector, "attention")
        want_fn = expected_async if cls.supports_async_dp or spec.sharded else expected
        session = AttentionSession(config, cls(config, rank, shape), rank,
                                   new_connector=lambda cfg: cls(cfg, rank, shape))
        session.start_connecting()
        session.startup_done()
        step, after, end = 0, 0, time.monotonic() + 120
        while after < steps_after:
            n = tokens(step, rank, 0) + 1

            def forward(step=step, n=n):
                for layer in range(spec.num_layers):
                    x, ids, w = make_inputs(spec, step, rank, layer, 0, n)
                    out = session.remote_experts(f"model.layers.{layer}.mlp.experts", x, w, ids)
                    if not torch.equal(out, want_fn(x, layer, 0, ids, w)):
                        raise AssertionError(f"rank {rank} step {step} layer {layer} differs")
                return session.worlds

            worlds = session.run_forward(forward)
            after += worlds >= 2
            q.put(("step", rank, step))
            step += 1
            if time.monotonic() > end:
                raise TimeoutError(f"{step} steps, {after} on the second FFN world")
        q.put(("ok", rank, {"steps": step, "worlds": session.worlds}))
        session.close()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


@pytest.mark.parametrize("connector,A,F,stages", [("P2pAFDConnector", 2, 1, 2),
                                                  ("CAMP2pAFDConnector", 1, 2, 2),
                                                  ("CAMAsyncAFDConnector", 2, 2, 1)])
def test_attention_ranks_ride_through_a_killed_ffn_role(connector, A, F, stages):
    """SIGKILL every FFN rank mid-run and start new ones: each attention rank (A > F, A < F,
    A = F) closes the lost world, joins the new one and runs the interrupted step again; every
    result of every step is exact."""
    spec = Spec(A, F, connector=connector, num_layers=3, stages=stages, gate_on_attention=True,
                sharded=F > 1, timeout_s=20, port=free_port(),
                extra={"reconnect_timeout_s": 60})
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ranks = [ctx.Process(target=_riding_attention_rank, args=(spec, a, 20, q), daemon=True)
             for a in range(A)]
    service = Service(spec, F)
    for p in ranks:
        p.start()
    done: dict[int, tuple] = {}
    steps = [0] * A

    def drain(until, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while not until() and time.monotonic() < end:
            try:
                kind, rank, detail = q.get(timeout=0.5)
            except queue.Empty:
                continue
            if kind == "step":
                steps[rank] = detail + 1
            else:
                done[rank] = (kind, detail)

    try:
        drain(lambda: min(steps) >= 10 or done, 60)
        assert not done and min(steps) >= 10, (steps, done)
        for p in service.procs:
            p.kill()
        join_or_kill(service.procs)
        killed_at = list(steps)
        time.sleep(1)
        service = Service(spec, F)
        drain(lambda: len(done) == A, 120)
        print(f"{connector} {A}A{F}F: FFN ranks killed after steps {killed_at}; {done}")
        assert all(done.get(a, ("missing",))[0] == "ok" for a in range(A)), done
        assert all(detail["worlds"] == 2 for _, detail in done.values()), done
    finally:
        for commands, _ in service.links:
            commands.put("stop")
        join_or_kill(service.procs, timeout_s=15)
        join_or_kill(ranks)
