"""Spawned ranks sharing one Gloo group registered by name, for tests of the afd_ascend ops.

``run_op_world(fn, world_size, *args)`` runs ``fn(rank, group_name, *args)`` in every rank (fn
must be a module-level function) and returns each rank's return value; a rank's exception fails
the test with that rank's traceback. Never hangs: the whole world is bounded by ``deadline_s``.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from afd_common.tools.launch import free_port
from afd_common.transport.process_groups import new_group, register_named_group

GROUP = "afd-test-ops"


def join_or_kill(procs, timeout_s: float = 5) -> None:
    """Reap spawned ranks: whatever has not ended within ``timeout_s`` is killed."""
    for p in procs:
        p.join(timeout=timeout_s)
        if p.is_alive():
            p.kill()
            p.join()


def _entry(fn, rank, size, port, timeout_s, args, q):
    torch.set_num_threads(1)
    try:
        import afd_ascend_ops

        afd_ascend_ops.ensure_cam_async_ops_available("cpu")
        store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timedelta(seconds=30))
        backend = new_group("gloo", store, "ops", rank, size, timeout_s, "127.0.0.1")
        pg = register_named_group(backend, store, rank, size, GROUP, torch.device("cpu"))
        result = fn(rank, GROUP, *args)
        # No rank exits before every rank has what it was sent: under in-order matching a send
        # may still wait in its lane when the sender's own part is done.
        try:
            backend.barrier().wait()
        except RuntimeError:
            pass  # a peer is gone; its own result says why
        q.put((rank, "ok", result))
        del pg
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_op_world(fn, world_size: int, *args, timeout_s: float = 10.0, deadline_s: float = 90.0):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, timeout_s, args, q),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    end = time.monotonic() + deadline_s
    try:
        while len(results) < world_size:
            left = end - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, value = q.get(timeout=min(left, 1.0))
                results[rank] = (status, value)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    time.sleep(0.5)
                    while not q.empty():
                        rank, status, value = q.get()
                        results[rank] = (status, value)
                    break
    finally:
        join_or_kill(procs)
    errors = [f"rank {r}: {v}" for r, (s, v) in sorted(results.items()) if s != "ok"]
    missing = [r for r in range(world_size) if r not in results]
    assert not errors and not missing, "\n".join(errors + [f"rank {r}: no result (hung or died)"
                                                          for r in missing])
    return [results[r][1] for r in range(world_size)]


def ffn_rank_dying_at(spec, rank: int, die_at: tuple[int, int]) -> dict:
    """``afd-selftest``'s FFN rank, which exits hard (status 17) when it reaches the (step,
    layer) ``die_at``: a role killed mid-step. For ``run_world(..., rank_fns=...)`` through
    ``functools.partial``."""
    import os

    from afd_common.registry import resolve_connector
    from afd_common.tools.selftest import ffn_rank

    cls = resolve_connector(spec.connector, "ffn")
    recv_layer = cls.recv_layer

    def dying(self, stage_idx, layer_idx, max_num_tokens=None):
        if (self._plan.step, layer_idx) == die_at:
            os._exit(17)
        return recv_layer(self, stage_idx, layer_idx, max_num_tokens)
    cls.recv_layer = dying
    return ffn_rank(spec, rank)
