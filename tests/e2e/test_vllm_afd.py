"""Two `vllm serve` roles give the colocated answer; a wrong FFN gives another; stops are clean."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from afd_common.tools.launch import PROMPTS, compare, complete, wait_gone
from afd_common.vllm_glue.lifecycle import FAILED_EXIT_CODE
from afd_common.placement import ExpertPlacement

from afd_common.tools.bench.hosts import Hosts

from .conftest import (AUTH_SECRET, FAMILY_CONTROLS, NUM_EXPERTS, NUM_PROMPTS, RIDE_THROUGH_TOKENS,
                       SHARDED_CONTROL_RANKS, RequestStream, afd_pair, get, kill_all, long_request,
                       say)

pytestmark = pytest.mark.e2e


def weights(server) -> dict:
    """The first ``AFD weights:`` line of a server's log, by category."""
    return weights_by_rank([server])[0]


def weights_by_rank(servers) -> dict[int, dict]:
    """Every worker's ``AFD weights:`` line (one per DP rank) in the servers' logs, by rank."""
    return {rank: held for server in servers for rank, held in server.weights().items()}


def routed_numel_per_expert(model_dir) -> int:
    """Elements of one routed expert over all MoE layers: gate, up [I, H] and down [H, I], and
    their biases [2I] and [H] where the model has them (gpt-oss)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    info = json.loads((model_dir / "afd_tiny_model.json").read_text())
    h, inter = info["shape"]["hidden_size"], info["shape"]["moe_intermediate_size"]
    moe_layers = cfg["num_hidden_layers"] - cfg.get("first_k_dense_replace", 0)
    biases = 2 * inter + h if info["arch"] == "gpt_oss" else 0
    return (3 * h * inter + biases) * moe_layers


# Prompt lookup proposes tokens the target model verifies several at a time: a step of AFD with
# more tokens per request, the same answers (greedy).
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


# A role started alone waits this long for its first step; the other's start-up outlasts it.
FIRST_STEP_TIMEOUT_S = 15
# The other role starts this long after the one started alone (once that one is ready).
ROLES_APART_S = 60
# A new FFN role starts this long after the last one was lost (the attention role waits).
RESTART_AFTER_S = 10
# How long the attention role waits for a new FFN role in these cases: one of two DP ranks
# (vLLM's start-up beside the waiting attention role) was back up to 153 s after the loss on 2
# cores without bytecode, too close to the default 120 s; below vLLM's 300 s execute timeout (DP
# attention ranks). The bound itself is test_reliability's.
RIDE_THROUGH_BOUND_S = 240


@dataclass(frozen=True)
class Case:
    """One AFD deployment compared with colocated vLLM."""

    arch: str
    gate_on_attention: bool
    A: int = 1
    F: int = 1
    connector: str = "P2pAFDConnector"
    m: int = 1
    sharded: bool = False  # --enable-expert-parallel on both roles
    inorder: bool = False  # AFD_TEST_INORDER=1 on both roles: NCCL/HCCL matching on Gloo
    ngram: bool = False  # n-gram speculative decoding on the attention role
    hosts: bool = False  # every DP rank on a host (network namespace) of its own
    first: str | None = None  # this role starts alone, the other once it is ready
    ride_through: str | None = None  # the FFN role gets this signal under load, then a new one
    cut_link: bool = False  # (hosts) the FFN rank 0 host unplugged mid-decode, at the end
    auth: bool = False  # an auth token in the config (where vLLM prints its arguments)
    attention_restart: bool = False  # SIGKILL the attention role, start another: same FFN role

    @property
    def small(self) -> bool:
        """One attention and one FFN rank on loopback, no restart: may run beside anything."""
        return (self.A == self.F == 1 and not self.hosts and not self.ride_through
                and not self.attention_restart)

    @property
    def id(self) -> str:
        place = "sharded" if self.sharded else "replicated"
        return (f"{self.arch}-gate_on_{'attention' if self.gate_on_attention else 'ffn'}-"
                f"{self.A}A{self.F}F-{place}-{self.connector}-m{self.m}"
                + ("-inorder" if self.inorder else "") + ("-ngram" if self.ngram else "")
                + ("-hosts" if self.hosts else "")
                + (f"-{self.first}_first" if self.first else "")
                + (f"-ffn_{self.ride_through}_restart" if self.ride_through else ""))

    def afd(self) -> dict:
        extra: dict = {}
        cec: dict = {}  # connector_extra_config
        if self.connector == "CAMAsyncAFDConnector":
            extra["async_dp"], cec["ops_backend"] = True, "portable"
        if self.m > 1:
            cec["num_micro_batches"] = self.m
        if self.auth:
            cec["auth_token"] = AUTH_SECRET
        if self.ride_through:
            cec["reconnect_timeout_s"] = RIDE_THROUGH_BOUND_S
        if self.cut_link:  # only the step timeout can end the wait; no ride-through
            cec["step_timeout_s"], cec["reconnect_timeout_s"] = CUT_STEP_TIMEOUT_S, 0
        if self.first:
            # Waiting for the other role is not bounded by the first step's timeout (the old
            # rule): the other's start-up alone outlasts it (checked).
            extra["first"], cec["first_step_timeout_s"] = self.first, FIRST_STEP_TIMEOUT_S
            extra["apart_s"] = ROLES_APART_S
        if cec:
            extra["connector_extra_config"] = cec
        return dict(num_attention_ranks=self.A, num_ffn_ranks=self.F, connector=self.connector,
                    compute_gate_on_attention=self.gate_on_attention,
                    vllm_args=("--enable-expert-parallel",) if self.sharded else (),
                    env={"AFD_TEST_INORDER": "1"} if self.inorder else None,
                    attention_args=("--speculative-config", json.dumps(NGRAM)) if self.ngram
                    else (), **extra)


# Every case is one server pair; each exists for a reason. Micro-batching (m = 2, 3) rides on
# cases that exist anyway: the answers must not change with m. Expert counts: DeepSeek-V2 8,
# Qwen3-MoE 7 (conftest.NUM_EXPERTS), so F = 2 on Qwen3 and F = 3 on DeepSeek do not divide them.
# DeepSeek-V2 with the gate on the FFN role is served in test_reliability (64 mixed requests);
# A > F with replicated experts by the multi-process tests.
CASES = [
    # The README's scale-out recipe: 2 FFN ranks each holding every expert in full (the gate on
    # the FFN role; the first round's recipe failed here: vLLM made it tensor-parallel).
    # It also rides through an FFN crash, with an auth token, and serves a second attention role.
    Case("qwen3_moe", False, F=2, m=2, ride_through="SIGKILL", auth=True,
         attention_restart=True),
    # Experts sharded over the FFN ranks: M2N dispatch from the attention side, A < F with 3
    # micro-batches over P2P under in-order matching (AFD_TEST_INORDER, as on NCCL; A = F is in
    # the CAM cases below and the multi-process tests), an uneven share (7 experts on 2 ranks).
    # More FFN ranks (3, uneven) and every m, split and dummy step: the multi-process and the
    # loopback tests (tests/test_attention_data_path.py), in seconds.
    Case("qwen3_moe", True, F=2, m=3, sharded=True, inorder=True, hosts=True, cut_link=True),
    # The CAM connectors move the rows through the afd_ascend ops (portable kernels over Gloo),
    # both under in-order matching, as on HCCL: CAMP2p sharded (M2N through a2e/e2a), CAMAsync
    # with async DP and the FFN role's receive loop as the clock.
    Case("qwen3_moe", True, A=2, F=2, connector="CAMP2pAFDConnector", m=2, sharded=True,
         inorder=True, ride_through="SIGTERM"),
    Case("deepseek_v2", True, A=2, F=2, connector="CAMAsyncAFDConnector", sharded=True,
         inorder=True, ride_through="SIGKILL"),
    # Every other architecture of afd_common.vllm_glue.models, 1A1F over P2P, with the gate where
    # the table puts it (DeepSeek-V2 1A1F with the gate on the FFN role: the load pair of
    # test_reliability). DeepSeek-V3 also with 2 attention ranks and m = 2.
    Case("deepseek_v3", False),
    Case("deepseek_v3", True, A=2, m=2, hosts=True),
    # Each role started alone once: neither's start-up waits for the other.
    Case("glm4_moe", True, first="attention"),
    Case("gpt_oss", True),
    Case("mixtral", True),
    Case("olmoe", True, first="ffn"),
    Case("qwen2_moe", True, ngram=True),
]


@pytest.mark.parametrize("case", [
    pytest.param(c, id=c.id, marks=[pytest.mark.any_worker] if c.small else []) for c in CASES])
def test_afd_matches_colocated_then_the_ffn_role_outlives_its_attention_role(case, models,
                                                                           colocated, logs,
                                                                           request):
    hosts = request.getfixturevalue("hosts") if case.hosts else None
    with afd_pair(case.id, logs, models[case.arch], hosts=hosts, **case.afd()) as pair:
        answers = complete(pair.attention, PROMPTS[:NUM_PROMPTS])
        problems = compare(answers, colocated[case.arch])
        assert not problems, "\n".join(problems)
        assert len(answers) == NUM_PROMPTS and all(len(a["tokens"]) == 32 for a in answers)
        if case.first:  # the role started alone waited longer than its first step's timeout
            assert pair.apart_s > FIRST_STEP_TIMEOUT_S, pair.apart_s
        if case.m > 1:  # the steps really were split (the prompts arrive together, so they can be)
            assert f"split into {case.m} micro-batches" in pair.attention.log_path.read_text()
        if case.ngram:  # the proposer really proposed, and the target accepted some
            accepted = sum(float(line.rsplit(" ", 1)[1]) for line in
                           get(pair.attention.url + "/metrics").splitlines()
                           if line.startswith("vllm:spec_decode_num_accepted_tokens_total"))
            say(f"{case.id}: {accepted:.0f} speculated tokens accepted")
            assert accepted > 0
        if case.inorder:
            for server in pair.servers:
                assert "AFD_TEST_INORDER=1" in server.log_path.read_text(), server.name
        check_metrics(pair, case)
        if case.A > 1:
            log = pair.ffn.log_path.read_text()
            assert f"handshake with {case.A + case.F - 1} peers ok" in log
        check_weights(pair, case, models[case.arch])
        if case.auth:
            for server in pair.servers:
                log = server.log_path.read_text(errors="replace")
                assert "auth_token" in log and AUTH_SECRET not in log, server.name
        if case.ride_through:
            ffn_restarts_under_load(pair, case, colocated, logs)
        if case.attention_restart:
            the_ffn_role_outlives_a_killed_attention_role(pair, case, colocated, logs)

        # The FFN role's front end refuses generation and reports the loops of the ranks it
        # runs (on hosts: its own; a headless rank's failure ends its engine, which vLLM's check
        # reports).
        status = json.loads(get(pair.ffn.url + "/health"))
        assert status["healthy"] and len(status["ranks"]) == (1 if case.hosts else case.F)
        assert all(rank["steps"] > 0 for rank in status["ranks"])
        with pytest.raises(Exception, match="400"):
            complete(pair.ffn, PROMPTS[:1])

        if case.cut_link:
            cut_link_fails_fast(pair, hosts)
        else:
            # Ctrl-C / SIGTERM on the attention server ends it cleanly; the FFN role, a service,
            # stays up for the next attention role until it is stopped itself.
            sigterm_attention_then_ffn(pair)


def check_weights(pair, case: Case, model_dir) -> None:
    """Role-pruned weights, counted by name on each side; each FFN rank holds every routed
    expert in full (replicated) or exactly its share (sharded)."""
    attn, ffn = weights(pair.attention), weights_by_rank(pair.ffn_ranks)
    say(f"{case.id}: attention holds {sorted(attn)}, FFN ranks hold "
        f"{ {f: w['routed_experts']['numel'] for f, w in sorted(ffn.items())} } routed-expert "
        f"elements; RSS attention {pair.attention.rss_bytes() / 2**20:.0f} MiB, FFN "
        f"{pair.ffn.rss_bytes() / 2**20:.0f} MiB")
    assert "routed_experts" not in attn and {"attention", "embedding", "lm_head"} <= set(attn)
    assert sorted(ffn) == list(range(case.F)), f"AFD weights lines of FFN ranks {sorted(ffn)}"
    placement = ExpertPlacement("sharded" if case.sharded and case.F > 1 else "replicated",
                                NUM_EXPERTS[case.arch], case.F)
    per_expert = routed_numel_per_expert(model_dir)
    for f, held in ffn.items():
        assert not {"attention", "embedding", "lm_head"} & set(held)
        want = per_expert * len(placement.local_experts(f))
        assert held["routed_experts"]["numel"] == want, (f, held["routed_experts"], want)


def afd_series(server) -> dict[str, float]:
    """The afd_* samples of a server's /metrics, by name and labels."""
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in get(server.url + "/metrics").splitlines() if line.startswith("afd_")}


def check_metrics(pair, case: Case) -> None:
    """Both roles' /metrics carry the AFD series while serving; with one attention rank and one
    FFN rank every attention round trip is one FFN work item, so the counts agree exactly. The
    rows each FFN rank received equal the rows the attention side sent it, and the expert-load
    series count every (token, expert) pair exactly once."""
    connector = case.connector
    def sample(series, name, role, **more):
        labels = ",".join(f'{k}="{v}"' for k, v in
                          sorted({"connector": connector, "role": role, **more}.items()))
        key = f"{name}{{{labels}}}"
        assert key in series, f"{key} missing from /metrics; AFD series: {sorted(series)}"
        return series[key]

    def routed(series, role):
        return [series.get(f'afd_routed_rows_total{{connector="{connector}",ffn_rank="{f}",'
                           f'role="{role}"}}') for f in range(case.F)]

    # Idle DP ranks may still run a dummy step between the two scrapes: read both again until
    # they agree (bounded), then require agreement.
    deadline = time.monotonic() + 20
    while True:
        attn, ffn = afd_series(pair.attention), afd_series(pair.ffn)
        if routed(attn, "attention") == routed(ffn, "ffn") or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for name in ("afd_layer_roundtrip_seconds", "afd_attention_compute_seconds",
                 "afd_wait_seconds", "afd_step_seconds"):
        assert sample(attn, f"{name}_count", "attention") > 0
        assert sample(attn, f"{name}_sum", "attention") > 0
    assert sample(attn, "afd_bytes_total", "attention", direction="sent") > 0
    assert sample(ffn, "afd_ffn_compute_seconds_count", "ffn") > 0
    assert sample(ffn, "afd_wait_seconds_count", "ffn") > 0
    assert sample(ffn, "afd_bytes_total", "ffn", direction="received") > 0
    if case.A == 1 and case.F == 1:
        assert (sample(attn, "afd_layer_roundtrip_seconds_count", "attention")
                == sample(ffn, "afd_ffn_compute_seconds_count", "ffn"))
    for f in range(case.F):
        sent = sample(attn, "afd_routed_rows_total", "attention", ffn_rank=f)
        assert sent > 0 and sent == sample(ffn, "afd_routed_rows_total", "ffn", ffn_rank=f), f
    rows = sum(v for k, v in attn.items() if k.startswith("afd_routed_rows_total"))
    pairs = sum(v for k, v in ffn.items() if k.startswith("afd_expert_rows_total"))
    experts = {k.split('expert="')[1].split('"')[0] for k in ffn
               if k.startswith("afd_expert_rows_total")}
    assert len(experts) == NUM_EXPERTS[case.arch], experts
    top_k = 2
    if case.connector == "CAMAsyncAFDConnector":  # rows on the wire are (token, expert) pairs
        assert pairs == rows
    elif case.sharded and case.F > 1:  # a row travels to 1..top_k ranks
        assert rows <= pairs <= top_k * rows
    else:
        assert pairs == top_k * rows
    say(f"{case.id}: rows per FFN rank "
        f"{[sample(ffn, 'afd_routed_rows_total', 'ffn', ffn_rank=f) for f in range(case.F)]}, "
        f"{pairs:.0f} (token, expert) pairs over {len(experts)} experts")


def exit_codes(servers) -> str:
    """Stopped on purpose, a server exits 0: which did not, with what, and its log's end."""
    return "\n".join(f"{s.name} exited {s.proc.returncode}:\n{s.log_tail(15)}" for s in servers
                     if s.proc.returncode != 0)


def afd_log_lines(server, last: int = 40) -> str:
    """What a server's AFD code logged, and its errors: why a case failed, in the CI output."""
    lines = server.log_path.read_text(errors="replace").splitlines()
    return "\n".join([line[:400] for line in lines
                       if "AFD" in line or "Error" in line or "error" in line][-last:])


def ffn_restarts_under_load(pair, case: Case, colocated, logs) -> None:
    """8 clients stream greedy 64-token requests while the FFN role gets ``case.ride_through``
    (SIGKILL: a crash; SIGTERM: a rolling update) and a new one starts RESTART_AFTER_S later:
    every request gets the colocated tokens and none errors; the attention server is the same
    process throughout and answers /health with 503 and its reason while it waits."""
    how = case.ride_through
    reference = [a["tokens"] for a in colocated[f"{case.arch}-{RIDE_THROUGH_TOKENS}"]]
    pids = [s.proc.pid for s in pair.attention_ranks]
    with RequestStream(pair.attention, PROMPTS[:NUM_PROMPTS], RIDE_THROUGH_TOKENS) as stream:
        stream.wait_done(8, 300)
        lost = time.monotonic()
        for server in pair.ffn_ranks:
            if how == "SIGKILL":
                kill_all(server)
            else:
                server.signal(signal.SIGTERM)
        assert wait_gone(pair.ffn_ranks, 30), "\n".join(s.log_tail() for s in pair.ffn_ranks)
        while pair.attention.health() != 503 and time.monotonic() < lost + RESTART_AFTER_S:
            time.sleep(0.2)
        waiting = json.loads(get(pair.attention.url + "/health", ok_only=False))
        assert not waiting["healthy"] and waiting["ranks"], waiting
        time.sleep(max(0.0, lost + RESTART_AFTER_S - time.monotonic()))
        pair.ffn_ranks = [dataclasses.replace(  # same flags, cores, host and port
            s, name=f"{s.name}-after-{how}", log_path=logs / f"{s.name}-after-{how}.log",
            proc=None).start() for s in pair.ffn_ranks]
        pair.ffn.wait_ready(progress=say, others=(*pair.ffn_ranks[1:], pair.attention))
        before = stream.done
        stream.wait_done(before + 8, 300)
        say(f"{case.id}: {how} on the FFN role, a new one {RESTART_AFTER_S} s later: {before} "
            f"requests done before it served, {stream.done} now; /health while waiting: "
            f"{waiting['reason']!r}, {len(waiting['ranks'])} rank(s) waiting; back "
            f"{time.monotonic() - lost:.0f} s after the loss")
    errors = [(i, out) for i, out in stream.results if not isinstance(out, list)]
    # A string: pytest cuts any other message to a line, and the log is what says why.
    assert not errors, f"{errors[:3]}\n{afd_log_lines(pair.attention)}"
    wrong = [i for i, out in stream.results if out != reference[i]]
    assert not wrong, f"{len(wrong)} of {len(stream.results)} requests differ: prompts {wrong}"
    assert [s.proc.pid for s in pair.attention_ranks] == pids and not any(
        s.exited() for s in pair.attention_ranks)
    assert pair.attention.health() == 200


def the_ffn_role_outlives_a_killed_attention_role(pair, case: Case, colocated, logs) -> None:
    """SIGKILL the attention role: the FFN role, the same process, names the loss and waits; a
    new attention role then gets the colocated answers through it."""
    old = pair.attention
    pids = [s.proc.pid for s in pair.ffn_ranks]
    killed = time.monotonic()
    kill_all(old)
    while True:  # the loop closes the lost world, then waits for the next
        ranks = json.loads(get(pair.ffn.url + "/health"))["ranks"]
        if all(r["state"] == "waiting" for r in ranks) or time.monotonic() > killed + 30:
            break
        time.sleep(0.5)
    say(f"SIGKILL attention: the FFN role waits for the next after "
        f"{time.monotonic() - killed:.1f} s: {ranks}")
    assert all(r["healthy"] and r["state"] == "waiting" for r in ranks), ranks
    assert all("attention rank 0" in r["error"] for r in ranks), ranks
    pair.attention_ranks = [dataclasses.replace(old, name=f"{old.name}-2", proc=None,
                                                log_path=logs / f"{old.name}-2.log").start()]
    pair.attention.wait_ready(progress=say, others=tuple(pair.ffn_ranks))
    problems = compare(complete(pair.attention, PROMPTS[:NUM_PROMPTS]), colocated[case.arch])
    assert not problems, "\n".join(problems)
    assert [s.proc.pid for s in pair.ffn_ranks] == pids
    ranks = json.loads(get(pair.ffn.url + "/health"))["ranks"]
    assert all(r["attention_worlds"] == 2 for r in ranks), ranks


CUT_STEP_TIMEOUT_S = 10


def _connects(hosts: Hosts | None, i: int, address: str, port: int) -> bool:
    """Whether a TCP connection to ``address:port`` from host ``i`` (None: this process's
    namespace) is accepted."""
    probe = ("import socket,sys\ntry:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])),"
             " timeout=5).close()\nexcept OSError:\n    sys.exit(1)")
    wrap = [] if hosts is None else hosts.wrap(i)
    return subprocess.run([*wrap, sys.executable, "-c", probe, address, str(port)],
                          timeout=30).returncode == 0


def cut_link_fails_fast(pair, hosts: Hosts) -> None:
    """The rendezvous listens on the configured address only: reachable there from the attention
    host, refused on the FFN host's loopback. Then the FFN rank 0 host is unplugged mid-decode: no
    connection closes, so only the step timeout can end the wait. The request fails within it
    and the attention role stops (status 3, ``reconnect_timeout_s`` 0); plugged back in, every
    FFN rank learns its peer is gone and waits for the next attention role."""
    attention, port = pair.attention, pair.port
    ffn_host = len(pair.attention_ranks)  # afd_pair: attention ranks on hosts 0.., then FFN
    assert _connects(hosts, 0, hosts.address(ffn_host), port)
    assert not _connects(hosts, ffn_host, "127.0.0.1", port)
    try:  # the hosts outlive this test: a failure here must not leave the next one unplugged
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(long_request, attention)
            time.sleep(1.5)
            assert not fut.done(), "generation finished before the cut; make it longer"
            cut = time.monotonic()
            hosts.cut(ffn_host)
            status, detail = fut.result(timeout=CUT_STEP_TIMEOUT_S + 30)
            took = time.monotonic() - cut
        say(f"link to the FFN host cut: in-flight request ended with {status} after {took:.1f} s")
        assert status != 200 and took <= CUT_STEP_TIMEOUT_S + 10, (status, detail)
        assert wait_gone([attention], 30), attention.log_tail()
        assert attention.proc.returncode == FAILED_EXIT_CODE
        # A receive or a send may be what waits when the link goes: either names the timeout.
        log = attention.log_path.read_text(errors="replace")
        assert f"within {float(CUT_STEP_TIMEOUT_S)} s" in log, attention.log_tail()
    finally:
        hosts.restore(ffn_host)
    end = time.monotonic() + 120
    while True:  # the front end's rank by /health, the headless one (no HTTP) by its log
        state = json.loads(get(pair.ffn.url + "/health"))["ranks"][0]["state"]
        logged = all("waiting for the next attention role" in s.log_path.read_text(
            errors="replace") for s in pair.ffn_ranks[1:])
        if (state == "waiting" and logged) or time.monotonic() > end:
            break
        time.sleep(1)
    say(f"every FFN rank waits for the next attention role {time.monotonic() - cut:.1f} s "
        f"after the cut")
    assert state == "waiting" and logged, "\n".join(s.log_tail() for s in pair.ffn_ranks)
    assert not any(s.exited() for s in pair.ffn_ranks)


def sigterm_ends_both(pair, servers) -> None:
    """SIGTERM the FFN role (each of its servers: on several hosts, vLLM's headless DP ranks are
    stopped host by host, as their front end does not stop them): both roles must be gone within
    30 s, as an attention role cannot serve without its FFN role. It exits 0 when the FFN
    worker said goodbye before vLLM's shutdown killed it, else 3 (a lost peer)."""
    start = time.monotonic()
    for server in servers:
        server.signal(signal.SIGTERM)
    assert wait_gone(pair.servers, 30), "\n".join(
        f"{s.name}: processes left {s.pids()}\n{s.log_tail()}" for s in pair.servers)
    say(f"SIGTERM on {servers[0].name}: both roles gone after {time.monotonic() - start:.1f} s, "
        f"exit codes: attention {pair.attention.proc.returncode}, FFN {pair.ffn.proc.returncode}")


def sigterm_attention_then_ffn(pair) -> None:
    """SIGTERM the attention role (each of its servers): it exits 0 within 30 s, and every FFN
    rank, still the same process, reports that it waits for the next attention role. Then
    SIGTERM the FFN role: it exits 0 within 30 s."""
    start = time.monotonic()
    pids = [s.proc.pid for s in pair.ffn_ranks]
    for server in pair.attention_ranks:
        server.signal(signal.SIGTERM)
    assert wait_gone(pair.attention_ranks, 30), "\n".join(
        f"{s.name}: processes left {s.pids()}\n{s.log_tail()}" for s in pair.attention_ranks)
    assert all(s.proc.returncode == 0 for s in pair.attention_ranks), exit_codes(pair.attention_ranks)
    end = time.monotonic() + 30
    while True:
        ranks = json.loads(get(pair.ffn.url + "/health"))["ranks"]
        if all(r["state"] == "waiting" for r in ranks) or time.monotonic() > end:
            break
        time.sleep(0.5)
    assert all(r["state"] == "waiting" and r["healthy"] for r in ranks), ranks
    assert [s.proc.pid for s in pair.ffn_ranks] == pids and not any(
        s.exited() for s in pair.ffn_ranks)
    say(f"SIGTERM on {pair.attention.name}: it is gone, the FFN role waits for the next "
        f"({time.monotonic() - start:.1f} s)")
    for server in pair.ffn_ranks:
        server.signal(signal.SIGTERM)
    assert wait_gone(pair.servers, 30), "\n".join(
        f"{s.name}: processes left {s.pids()}\n{s.log_tail()}" for s in pair.ffn_ranks)
    assert all(s.proc.returncode == 0 for s in pair.ffn_ranks), exit_codes(pair.ffn_ranks)


@dataclass(frozen=True)
class Control:
    """An AFD pair whose FFN role serves other routed-expert weights than the attention role's
    checkpoint: the answers must change."""

    arch: str
    ffn_model: str
    F: int = 1

    @property
    def id(self) -> str:
        return self.ffn_model


# One per family of afd_common.vllm_glue.models, by where the router runs: in vLLM's MoE layer
# (DeepSeek, Qwen3-MoE: the gate may run on the FFN role) or in the model (the others: routed on the
# attention role). Qwen3-MoE's experts are sharded over 2 FFN ranks with only the last rank's
# share reseeded: that share must come from that rank (the attention role holds no routed expert:
# check_weights; the other share is shown used by the equality cases).
CONTROLS = [Control("qwen3_moe", f"qwen3_moe-other-experts-f{SHARDED_CONTROL_RANKS - 1}",
                    F=SHARDED_CONTROL_RANKS),
            *(Control(arch, f"{arch}-other-experts") for arch in FAMILY_CONTROLS)]


@pytest.mark.any_worker
@pytest.mark.parametrize("control", CONTROLS, ids=[c.id for c in CONTROLS])
def test_negative_control_and_sigterm_on_ffn_ends_both(control, models, colocated, logs):
    """Then SIGTERM on the FFN server ends both roles within 30 s when the attention role is
    told not to wait for another FFN role (``reconnect_timeout_s`` 0)."""
    with afd_pair(f"negative-{control.id}", logs, models[control.arch],
                  ffn_model=models[control.ffn_model], num_ffn_ranks=control.F,
                  compute_gate_on_attention=True,
                  connector_extra_config={"reconnect_timeout_s": 0},
                  vllm_args=("--enable-expert-parallel",) if control.F > 1 else ()) as pair:
        answers = complete(pair.attention, PROMPTS[:NUM_PROMPTS])
        differing = compare(answers, colocated[control.arch])
        assert len(differing) >= NUM_PROMPTS // 2, differing
        sigterm_ends_both(pair, pair.ffn_ranks)
        assert pair.ffn.proc.returncode == 0, "the server stopped on purpose exits 0"
        assert pair.attention.proc.returncode in (0, FAILED_EXIT_CODE)
