"""The portable kernels of the four afd_ascend.afd_async_* ops between spawned ranks over Gloo.

World: A = 2 attention ranks [0, 2), M = 2 MoE ranks [2, 4), R = 2 local experts per MoE rank
(4 experts), top_k = 2, H = 64. Every attention rank builds its batches deterministically from
(world, case, layer, comm_id, rank), so the MoE ranks recompute what each attention rank sent and
check every work item (rows, scales, expert counts, batch_info) exactly. The MoE "experts" are
y = x * (e + 1) + layer for global expert e, and every attention rank checks combine_recv's
result against a reference computed locally:
- without quantization, exactly (float32 and bfloat16: the reference rounds where the ops do);
- with dynamic_quant = 1, exactly against the reference fed with the dequantized rows
  q * s (q = round(x / s), s = amax|row| / 127), and for float32 also against the unquantized
  reference within the quantization bound |err[t]| <= sum_k |w[t,k]| * (e_k + 1) * s_t / 2
  (+1e-5 relative slack for float32 rounding).
Each case ends with STOP from every attention rank; the MoE loop ends when it has counted a stop
item from every DP group. Every op call is repeated on meta tensors: the Meta kernel's output
shapes/dtypes must equal the CPU kernel's.
"""

from __future__ import annotations

import os
import queue
import re
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
import torch

pytestmark = pytest.mark.multiproc

A, M, R, K, H = 2, 2, 2, 2, 64
E = M * R
WORLD = A + M
MAX_SEQ = 32
GROUP = "afd_cam_async_test"
TIMEOUT_S = 8.0  # the Gloo group's timeout: a lost peer turns into an error within this
DEADLINE_S = 50.0  # per world, spawn included


@dataclass
class Case:
    dtype: torch.dtype
    quant: int
    cap: int
    comms: tuple[int, ...]
    layers: int
    B: tuple[int, int] = (4, 8)  # random batch sizes in [lo, hi]
    # (layer, rank) -> ("B0" | "pin", B): B = 0 tokens, or every token routed to experts (0, 1)
    special: dict = field(default_factory=dict)
    bad_capacity: bool = False  # attention ranks do not wait for the combine of pinned batches


CASES = {
    1: [
        # Several layers; attention rank 1 idle (B = 0) at layer 1; at layer 2 attention rank 0
        # routes only to MoE rank 2, so MoE rank 3 gets a zero-row item from DP group 0.
        Case(torch.float32, 0, 32, (0,), 3, special={(1, 1): ("B0", 0), (2, 0): ("pin", 6)}),
        # Capacity 8: 16 rows of attention rank 0 for MoE rank 2 at layer 0 split in two items.
        Case(torch.bfloat16, 0, 8, (3,), 3, special={(0, 0): ("pin", 8)}),
        Case(torch.bfloat16, 1, 8, (0,), 2, special={(1, 1): ("pin", 8)}),
        Case(torch.float32, 1, 32, (7,), 2),
        # A single local expert over the capacity: MoE rank 2 raises naming cap and count, and
        # the stream goes on (group 1's empty item, then the stops).
        Case(torch.float32, 0, 4, (0,), 1, special={(0, 0): ("pin", 6), (0, 1): ("B0", 0)},
             bad_capacity=True),
    ],
    2: [
        # One DP group of two members; two interleaved streams (comm_id 0 and 5); member 1 idle
        # at layer 1; at layer 2 both members route only to MoE rank 2 (MoE rank 3: empty item).
        Case(torch.float32, 0, 32, (0, 5), 3, B=(1, 6),
             special={(1, 1): ("B0", 0), (2, 0): ("pin", 3), (2, 1): ("pin", 2)}),
        # Capacity 8 with both members pinned to experts (0, 1): 8 + 8 rows split in two items
        # of two members each (offsets and per-member counts checked).
        Case(torch.bfloat16, 1, 8, (0,), 3, B=(1, 4),
             special={(0, 0): ("pin", 5), (0, 1): ("pin", 3)}),
    ],
}


# ---- deterministic data, shared by both sides ----

def batch(tp: int, ci: int, case: Case, layer: int, comm: int, rank: int):
    g = torch.Generator().manual_seed(((tp * 16 + ci) * 16 + layer) * 4096 + comm * 16 + rank)
    kind, b = case.special.get((layer, rank), (None, None))
    if kind is None:
        b = int(torch.randint(case.B[0], case.B[1] + 1, (1,), generator=g))
    x = (torch.randn(b, H, generator=g) * 3).to(case.dtype)
    if case.quant and b > 0:
        x[0] = 0  # an all-zero row: scale 1
    if kind == "pin":
        ids = torch.tensor([[0, 1]] * b)
    else:
        ids = torch.rand(b, E, generator=g).argsort(1)[:, :K]
    ids = ids.to(torch.int32 if rank % 2 else torch.int64)
    w = torch.rand(b, K, generator=g)
    if rank % 2:
        w = w.to(case.dtype)  # expert_scales may come in the model dtype
    return x, ids, w


def quantize(rows: torch.Tensor):
    xf = rows.float()
    amax = xf.abs().amax(1)
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(xf / s[:, None]).clamp(-127, 127).to(torch.int8), s


def routed_rows(x, ids, moe_rank):
    """This attention rank's rows for moe_rank in wire order, and per-local-expert counts."""
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    order = order[(flat[order] // R) == moe_rank - A]
    counts = [int((flat == (moe_rank - A) * R + e).sum()) for e in range(R)]
    return x[order // K] if len(order) else x[:0], counts


def expected_items(tp, ci, case, layer, comm, group, moe_rank):
    """The items MoE rank `moe_rank` must get for DP group `group`; None if one expert > cap."""
    rows, counts = [], []
    for m in range(tp):
        x, ids, _ = batch(tp, ci, case, layer, comm, group * tp + m)
        r, c = routed_rows(x, ids, moe_rank)
        rows.append(r)
        counts.append(c)
    total = [sum(c[e] for c in counts) for e in range(R)]
    if max(total) > case.cap:
        return None
    ranges = []
    if sum(total) == 0:
        ranges = [(0, R - 1)]
    else:
        first, acc = 0, 0
        for e in range(R):
            if acc + total[e] > case.cap:
                ranges.append((first, e - 1))
                first, acc = e, 0
            acc += total[e]
        ranges.append((first, R - 1))
    items = []
    for first, last in ranges:
        info, per, parts, off = [0] * 5, [], [], 0
        offsets = []
        for m in range(tp):
            offsets.append(off)
            pre = sum(counts[m][:first])
            cnt = sum(counts[m][first:last + 1])
            parts.append(rows[m][pre:pre + cnt])
            per += [counts[m][e] if first <= e <= last else 0 for e in range(R)]
            off += cnt
        info = [off, group * tp, layer, first, last] + offsets + per
        etc = [total[e] if first <= e <= last else 0 for e in range(R)]
        items.append((info, etc, torch.cat(parts) if parts else None))
    return items


def reference(x, ids, w, layer, dtype, quant, exact_quant=True):
    if quant and exact_quant:
        q, s = quantize(x)
        xr = q.float() * s[:, None]
    else:
        xr = x.float()
    acc = torch.zeros(x.shape[0], H)
    for k in range(K):
        gain = (ids[:, k].long() + 1).float()
        y = (xr * gain[:, None] + layer).to(dtype)
        acc = acc + y.float() * w[:, k].float()[:, None]
    return acc.to(dtype)


# ---- the ops, each checked against its Meta kernel ----

def call(name, *args):
    op = getattr(torch.ops.afd_ascend, name)
    out = op(*args)
    meta = op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
    outs, metas = (out, meta) if isinstance(out, list) else ([out], [meta])
    got = [(tuple(t.shape), t.dtype) for t in outs]
    want = [(tuple(t.shape), t.dtype) for t in metas]
    assert got == want, f"{name}: CPU outputs {got} != Meta outputs {want}"
    return out


COMM_ARGS = torch.zeros(8, dtype=torch.uint8)


def dispatch_send(x, ids, comm, layer, rank, tp, quant):
    return call("afd_async_dispatch_send", x, ids, COMM_ARGS, comm, MAX_SEQ, x.shape[0], H, K, M,
                A, R, rank, WORLD, layer, tp, quant, GROUP)


def dispatch_recv(template, comm, rank, tp, quant, moe_rank_id=None):
    return call("afd_async_dispatch_recv", template, COMM_ARGS, comm, MAX_SEQ, H, K, M, A, R,
                rank if moe_rank_id is None else moe_rank_id, WORLD, tp, quant, GROUP)


def combine_send(y, info, comm, rank, tp):
    return call("afd_async_combine_send", y, COMM_ARGS, info, comm, MAX_SEQ, H, K, M, A, R, rank,
                WORLD, tp, GROUP)


def combine_recv(template, ids, w, comm, rank):
    return call("afd_async_combine_recv", template, ids, w, COMM_ARGS, comm, ids.shape[0], H, K,
                M, A, R, rank, WORLD, GROUP)


# ---- the two roles ----

def attention(rank, tp):
    stats = defaultdict(int)
    if tp == 1 and rank == 0:  # bad input: refused before anything is sent
        x = torch.randn(2, H)
        with pytest.raises(RuntimeError, match=r"dispatch_send: expert_ids\[1, 0\] = 4 is "
                                               r"outside \[0, 4\)"):
            dispatch_send(x, torch.tensor([[0, 1], [4, 2]]), 0, 0, rank, tp, 0)
        with pytest.raises(RuntimeError, match="attn_rank_id 1 given, but this process is rank 0"):
            dispatch_send(x, torch.tensor([[0, 1], [3, 2]]), 0, 0, 1, tp, 0)
        stats["bad_inputs"] += 2
    for ci, case in enumerate(CASES[tp]):
        for layer in range(case.layers):
            sent = {}
            for comm in case.comms:
                x, ids, w = batch(tp, ci, case, layer, comm, rank)
                rows = dispatch_send(x, ids, comm, layer, rank, tp, case.quant)
                want = [routed_rows(x, ids, A + j)[0].shape[0] for j in range(M)]
                assert rows.tolist() == want, (rows, want)
                sent[comm] = (x, ids, w)
            if case.bad_capacity and case.special.get((layer, rank), ("",))[0] == "pin":
                # No result will come; combine_recv with other expert ids is refused before any
                # receive: they do not route the rows that dispatch_send sent.
                x, ids, w = sent[case.comms[0]]
                with pytest.raises(RuntimeError, match=r"combine_recv: expert_ids route \[0, 12\] "
                                   r"rows to the MoE ranks, but the oldest dispatch_send of "
                                   r"comm_id 0 not yet combined \(layer 0\) sent \[12, 0\]"):
                    combine_recv(torch.empty(0, H), ids + 2, w, case.comms[0], rank)
                stats["skipped_combine"] += 1
                continue
            for comm in case.comms:
                x, ids, w = sent[comm]
                out = combine_recv(torch.empty(0, H, dtype=case.dtype), ids, w, comm, rank)
                ref = reference(x, ids, w, layer, case.dtype, case.quant)
                assert out.dtype == case.dtype and out.shape == (x.shape[0], H)
                assert torch.equal(out, ref), (ci, layer, comm, (out.float() - ref.float()).abs()
                                               .max())
                if case.quant and case.dtype == torch.float32 and x.shape[0]:
                    true = reference(x, ids, w, layer, case.dtype, case.quant, exact_quant=False)
                    s = quantize(x)[1]
                    gain = (w.float().abs() * (ids.long() + 1).float()).sum(1)
                    bound = gain * s / 2 + 1e-5 * true.abs().amax(1)
                    err = (out - true).abs().amax(1)
                    assert (err <= bound).all(), (err, bound)
                    stats["quant_bound_checked"] += x.shape[0]
                stats["rows_checked"] += x.shape[0]
        for comm in case.comms:
            stop = dispatch_send(torch.empty(0, H, dtype=case.dtype),
                                 torch.empty(0, K, dtype=torch.int64), comm, -1, rank, tp, 0)
            assert stop.tolist() == [0] * M
    return dict(stats)


def moe(rank, tp):
    stats = defaultdict(int)
    groups = A // tp
    if tp == 1 and rank == A:
        with pytest.raises(RuntimeError, match="moe_rank_id 0 outside the MoE ranks"):
            dispatch_recv(torch.empty(4, H), 0, rank, tp, 0, moe_rank_id=0)
        stats["bad_inputs"] += 1
    for ci, case in enumerate(CASES[tp]):
        template = torch.empty(case.cap, H, dtype=case.dtype)
        stops = {c: set() for c in case.comms}
        got = defaultdict(int)  # (comm, group, layer) -> items seen
        errors = set()
        active = list(case.comms)
        while active:
            for comm in list(active):
                try:
                    ex, scales, etc, info = dispatch_recv(template, comm, rank, tp, case.quant)
                except RuntimeError as e:
                    m = re.search(r"local expert (\d+) of MoE rank \d+ got (\d+) rows from DP "
                                  r"group (\d+) at layer (\d+), more than the capacity cap = (\d+)",
                                  str(e))
                    if not case.bad_capacity or not m:
                        raise
                    assert int(m.group(5)) == case.cap
                    errors.add((comm, int(m.group(3)), int(m.group(4))))
                    continue
                info = info.tolist()
                assert len(info) == 5 + tp + R * tp
                n = info[0]
                if info[1] == -1:  # a stop item
                    assert n == 0 and info[2] == -1 and info[3] % tp == 0 and info[3] < A
                    assert info[3] not in stops[comm]
                    stops[comm].add(info[3])
                    stats["stop_items"] += 1
                    if len(stops[comm]) == groups:
                        active.remove(comm)
                    continue
                group, layer = info[1] // tp, info[2]
                assert info[1] % tp == 0 and info[1] not in stops[comm]
                want = expected_items(tp, ci, case, layer, comm, group, rank)
                assert want is not None, ("expected a capacity error", comm, group, layer)
                idx = got[(comm, group, layer)]
                got[(comm, group, layer)] += 1
                w_info, w_etc, w_rows = want[idx]
                assert info == w_info, (ci, comm, layer, info, w_info)
                assert etc.tolist() == w_etc
                assert ex.dtype == (torch.int8 if case.quant else case.dtype)
                assert ex.shape == (case.cap, H) and scales.shape == (case.cap,)
                if case.quant:
                    q, s = quantize(w_rows)
                    assert torch.equal(ex[:n], q) and torch.equal(scales[:n], s)
                    deq = ex[:n].float() * scales[:n, None]
                else:
                    assert torch.equal(ex[:n], w_rows)
                    deq = ex[:n].float()
                assert torch.equal(scales[n:], torch.ones(case.cap - n))  # rows past n: unset
                if not case.quant:
                    assert torch.equal(scales[:n], torch.ones(n))
                # The experts: y = x * (e + 1) + layer, row by row in the item's layout.
                gains = []
                for m in range(tp):
                    for e in range(R):
                        gains += [(rank - A) * R + e + 1] * info[5 + tp + m * R + e]
                y = torch.zeros(case.cap, H, dtype=case.dtype)
                y[:n] = (deq * torch.tensor(gains, dtype=torch.float32)[:, None] + layer
                         ).to(case.dtype)
                ret = combine_send(y, torch.tensor(info), comm, rank, tp)
                per_member = [sum(info[5 + tp + m * R:5 + tp + (m + 1) * R]) for m in range(tp)]
                assert ret.tolist() == per_member
                stats["items"] += 1
                stats["rows"] += n
                stats["empty_items"] += n == 0
                stats["split_items"] += n > 0 and (info[3] > 0 or info[4] < R - 1)
                stats["members_in_one_item"] = max(stats["members_in_one_item"],
                                                   sum(c > 0 for c in per_member))
        # Every (stream, group, layer) gave all its items, or the expected capacity error.
        for comm in case.comms:
            for group in range(groups):
                for layer in range(case.layers):
                    want = expected_items(tp, ci, case, layer, comm, group, rank)
                    if want is None:
                        assert (comm, group, layer) in errors
                        stats["capacity_errors"] += 1
                    else:
                        assert got[(comm, group, layer)] == len(want), (comm, group, layer)
        assert len(errors) == sum(expected_items(tp, ci, case, la, c, g, rank) is None
                                  for c in case.comms for g in range(groups)
                                  for la in range(case.layers))
    return dict(stats)


def _worker(rank, tp, port, q, die_rank):
    try:
        import torch.distributed as dist

        import afd_ascend_ops
        from afd_common.transport.process_groups import new_group, register_named_group

        torch.set_num_threads(1)
        afd_ascend_ops.ensure_cam_async_ops_available("cpu")
        store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0,
                              timeout=timedelta(seconds=TIMEOUT_S))
        backend = new_group("gloo", store, "cam_async", rank, WORLD, TIMEOUT_S, "127.0.0.1")
        # The registry holds the group weakly: keep it referenced while the ops run.
        pg = register_named_group(backend, store, rank, WORLD, GROUP, torch.device("cpu"))
        if die_rank is not None:
            pg.barrier().wait()  # everyone is connected before the victim goes
            if rank == die_rank:
                q.put((rank, "died", None, time.time()))
                time.sleep(0.2)
                os._exit(3)
        detail = attention(rank, tp) if rank < A else moe(rank, tp)
        pg.barrier().wait()  # every send was received before anyone exits
        q.put((rank, "ok", detail, time.time()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", time.time()))


def run_world(tp, die_rank=None):
    """Spawn the world; stop soon after the first failed rank; never hang.

    Returns {rank: (status, detail, wall-clock time of the report)}.
    """
    import multiprocessing as mp

    from afd_common.tools.launch import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, tp, port, q, die_rank), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    start = time.monotonic()
    results, failed_at = {}, None
    try:
        while len(results) < WORLD and time.monotonic() - start < DEADLINE_S:
            if failed_at is not None and time.monotonic() - failed_at > TIMEOUT_S + 2:
                break  # the others had their chance to notice and report
            try:
                rank, status, detail, when = q.get(timeout=0.2)
                results[rank] = (status, detail, when)
                if status != "ok" and failed_at is None:
                    failed_at = time.monotonic()
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in results and p.exitcode is not None:
                        time.sleep(0.2)  # its last message may still be in the pipe
                        if r not in results and q.empty():
                            results[r] = ("exit", p.exitcode, time.time())
                            failed_at = failed_at or time.monotonic()
    finally:
        for p in procs:
            p.join(timeout=10 if len(results) == WORLD else 0.1)  # exit takes a while on 2 busy cores
            if p.is_alive():
                p.kill()
                p.join()
    for r, p in enumerate(procs):
        results.setdefault(r, ("hung", None, time.time()))
        if results[r][0] == "ok" and p.exitcode != 0:  # e.g. a crash at exit
            results[r] = ("exit after ok", p.exitcode, results[r][2])
    return results


def run_ok(tp):
    results = run_world(tp)
    bad = [f"rank {r}: {st} {detail}" for r, (st, detail, _) in sorted(results.items())
           if st != "ok"]
    assert not bad, "\n".join(bad)
    return {r: detail for r, (_, detail, _) in results.items()}


def _total(res, key, ranks):
    return sum(res[r].get(key, 0) for r in ranks)


@pytest.mark.parametrize("inorder", [False, pytest.param(True, marks=pytest.mark.inorder)],
                         ids=["tagged", "inorder"])
def test_async_ops_tp1_layers_capacity_quant_stop_and_bad_input(inorder, monkeypatch):
    """Also under in-order matching (AFD_TEST_INORDER, as on HCCL): the MoE rank re-posts an
    attention rank's header receive only after returning its rows (or at once without rows, or
    after a failed call), so no combine ever queues behind a receive that cannot complete."""
    if inorder:
        monkeypatch.setenv("AFD_TEST_INORDER", "1")
    res = run_ok(tp=1)
    att, moe_ranks = range(A), range(A, WORLD)
    # What the attention ranks checked is what the MoE ranks served (rows x top_k).
    assert _total(res, "rows_checked", att) > 0
    assert _total(res, "quant_bound_checked", att) > 0
    assert _total(res, "stop_items", moe_ranks) == M * A * len(CASES[1])  # per MoE rank, group
    assert _total(res, "split_items", moe_ranks) >= 4  # two pinned layers, two items each
    assert _total(res, "empty_items", moe_ranks) > 0
    assert _total(res, "capacity_errors", moe_ranks) == 1
    assert _total(res, "skipped_combine", att) == 1
    assert _total(res, "bad_inputs", range(WORLD)) == 3
    # Every routed row was served once and checked once (the over-capacity layer excepted).
    assert _total(res, "rows", moe_ranks) == K * _total(res, "rows_checked", att)


def test_async_ops_tp2_members_interleaved_streams_and_split():
    res = run_ok(tp=2)
    moe_ranks = range(A, WORLD)
    n_stop_streams = sum(len(c.comms) for c in CASES[2])
    assert _total(res, "stop_items", moe_ranks) == M * n_stop_streams  # one DP group
    assert _total(res, "split_items", moe_ranks) >= 2
    assert _total(res, "empty_items", moe_ranks) > 0
    assert max(res[r]["members_in_one_item"] for r in moe_ranks) == 2
    assert _total(res, "rows", moe_ranks) == K * _total(res, "rows_checked", range(A)) > 0


def test_lost_attention_rank_fails_every_rank_fast():
    """Attention rank 1 exits: the MoE ranks' pending header receives fail at once (not at the
    group timeout, and not never: dispatch_recv itself has no timeout), naming the rank; then
    attention rank 0's combine_recv fails because the MoE ranks are gone."""
    results = run_world(tp=1, die_rank=1)
    status, _, died = results[1]
    assert status == "died", results[1]
    for r in (A, A + 1):
        st, detail, when = results[r]
        assert st == "error", (r, st, detail)
        assert "afd_async_dispatch_recv" in detail and "attention rank 1" in detail, detail
        assert "Connection closed" in detail or "closed by peer" in detail, detail
        assert when - died < TIMEOUT_S / 2, (r, when - died)
    st, detail, when = results[0]
    assert st == "error" and "MoE rank" in detail, (st, detail)
    assert when - died < TIMEOUT_S, when - died
