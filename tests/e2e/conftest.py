"""End-to-end fixtures: tiny checkpoints and real `vllm serve` processes, shared per session.

Every AFD server pair runs each role on its own core (attention on core 0, FFN on core 1); the
colocated reference runs alone. Servers are stopped at the end of the test that started them, and
the stop itself is checked (no process of either role may survive).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from afd_common.tools.launch import (BASE_ENV, COMMON_ARGS, PROMPTS, Server, afd_args, complete,
                               wait_gone)
from afd_common.placement import expert_owners
from afd_common.tools.launch import free_port
from afd_common.tools.tiny_model import write_tiny_model

from afd_common.tools.bench.hosts import Hosts

pytestmark = pytest.mark.e2e
NUM_PROMPTS = 16
# Every architecture of afd_common.vllm_glue.models (tiny_model.ARCHS), served colocated once each.
ARCHS = ("deepseek_v2", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss", "mixtral", "olmoe",
         "qwen2_moe")
# Routed experts per checkpoint: 8 mostly (3 FFN ranks do not divide it; CAMAsync's ops need an
# even share, 2 ranks do), 7 for Qwen3-MoE (2 FFN ranks do not divide it).
NUM_EXPERTS = {arch: 7 if arch == "qwen3_moe" else 8 for arch in ARCHS}
# The negative controls: Qwen3-MoE over 2 sharded FFN ranks with one rank's share reseeded, and
# one checkpoint per other routing family with every routed expert reseeded.
SHARDED_CONTROL_RANKS = 2
FAMILY_CONTROLS = ("mixtral",)  # the family that routes on the attention role
# Checkpoints whose FFN role is restarted under a stream of 64-token requests.
RIDE_THROUGH_ARCHS = ("qwen3_moe", "deepseek_v2")
RIDE_THROUGH_TOKENS = 64
AUTH_SECRET = "s3cret-afd-token-0042"  # must never appear in a log


_plugins = None


def say(msg: str) -> None:
    """Progress and measurements, shown live: pytest's capture is lifted for the one line."""
    if _plugins is None:
        print(f"[e2e] {msg}", file=sys.stderr, flush=True)
        return
    capture, reporter = _plugins
    with capture.global_and_fixture_disabled():
        if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's stdout is /dev/null, not stderr
            print(f"[e2e] {msg}", file=sys.__stderr__, flush=True)
        else:
            reporter.write_line(f"[e2e] {msg}")


@pytest.fixture(scope="session", autouse=True)
def _live_output(request):
    global _plugins
    manager = request.config.pluginmanager
    _plugins = (manager.get_plugin("capturemanager"), manager.get_plugin("terminalreporter"))
    yield
    _plugins = None


@pytest.fixture(scope="session")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def hosts():
    """Four hosts (network namespaces on one bridge), made when a test first asks; none of this
    harness's namespaces may be left after the session."""
    made = Hosts(4)
    # A run stopped with SIGTERM (CI's timeout, a killed job) still tears down: pytest runs the
    # finalizers on KeyboardInterrupt, not when SIGTERM's default action ends the process.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield made
    finally:
        signal.signal(signal.SIGTERM, previous)
        made.close()
        assert not made.leftovers(), f"left behind: {made.leftovers()}"


def run_dir(tmp_path_factory) -> Path:
    """A directory every worker of this run shares: xdist gives each worker a base temporary
    directory of its own, under one for the run."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    """Written once per run, under a lock, by the first worker that asks: every worker serves
    the same checkpoints the colocated reference answered for."""
    root = run_dir(tmp_path_factory) / "models"
    root.mkdir(exist_ok=True)
    index = root / "index.json"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not index.exists():
            written = {k: str(v) for k, v in _write_models(root).items()}
            index.write_text(json.dumps(written))
        return {k: Path(v) for k, v in json.loads(index.read_text()).items()}


def _write_models(root: Path) -> dict[str, Path]:
    out = {arch: write_tiny_model(arch, root / arch, seed=0, num_experts=NUM_EXPERTS[arch])
           for arch in ARCHS}
    # Same weights except the routed experts that the last FFN rank owns: a negative control.
    owners = expert_owners(NUM_EXPERTS["qwen3_moe"], SHARDED_CONTROL_RANKS, "linear")
    f = SHARDED_CONTROL_RANKS - 1
    out[f"qwen3_moe-other-experts-f{f}"] = write_tiny_model(
        "qwen3_moe", root / f"qwen3-other-f{f}", seed=0, experts_seed=12345,
        num_experts=NUM_EXPERTS["qwen3_moe"],
        reseed_experts=[e for e, r in enumerate(owners) if r == f])
    for arch in FAMILY_CONTROLS:
        out[f"{arch}-other-experts"] = write_tiny_model(
            arch, root / f"{arch}-other", seed=0, experts_seed=12345,
            num_experts=NUM_EXPERTS[arch])
    return {k: Path(v) for k, v in out.items()}


def mixed_load() -> list[tuple[str, int]]:
    """64 requests of mixed prompt and output lengths."""
    words = "alpha beta gamma delta river stone cloud light north seven".split()
    return [(" ".join(words[(i * 3 + j) % 10] for j in range(1 + i % 9)), 4 + (i * 7) % 29)
            for i in range(64)]


def run_mixed(server: Server) -> list[list[str]]:
    """Send the whole mixed load at once, one request each; token ids in request order."""
    def one(item):
        prompt, n = item
        return complete(server, [prompt], max_tokens=n)[0]["tokens"]
    with cf.ThreadPoolExecutor(64) as pool:
        return list(pool.map(one, mixed_load()))


def long_request(server: Server, max_tokens: int = 400):
    """One long greedy completion: (HTTP status or "connection", start of the body)."""
    body = json.dumps({"model": server.model, "prompt": "Once upon a time",
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()[:200]
    except urllib.error.HTTPError as e:
        return e.code, e.read()[:200]
    except OSError as e:
        return "connection", repr(e)


def get(url: str, ok_only: bool = True) -> str:
    """The body at ``url``; with ``ok_only`` False, also that of an error status."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:
        if ok_only:
            raise
        return e.read().decode()


def kill_all(server: Server) -> None:
    """SIGKILL every process of the server, as a crashed host would."""
    for pid in server.pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class RequestStream:
    """``clients`` threads, each sending one greedy request after another (the prompts in turn)
    until the ``with`` block ends; ``results`` holds (prompt index, token ids or the error)."""

    def __init__(self, server: Server, prompts: list[str], max_tokens: int, clients: int = 8):
        self.server, self.prompts, self.max_tokens = server, prompts, max_tokens
        self.results: list[tuple[int, object]] = []
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True)
                         for _ in range(clients)]

    def _client(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                i, self._next = self._next % len(self.prompts), self._next + 1
            try:
                out: object = complete(self.server, [self.prompts[i]], self.max_tokens,
                                       timeout_s=600)[0]["tokens"]
            except Exception as e:  # noqa: BLE001 - recorded: the test asserts there is none
                out = e
            with self._lock:
                self.results.append((i, out))

    @property
    def done(self) -> int:
        with self._lock:
            return len(self.results)

    def wait_done(self, n: int, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while self.done < n:
            assert time.monotonic() < end, f"{self.done} of {n} requests done in {timeout_s} s"
            assert not self.server.exited(), self.server.log_tail()
            time.sleep(0.2)

    def __enter__(self) -> RequestStream:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(600)


class ColocatedReference:
    """The reference: colocated vLLM per checkpoint, same engine flags, same prompts (vLLM's
    offline engine, ``colocated_reference.py``), in two processes (one core each, every other
    job); ``"<arch>-mixed"`` holds the token ids of the 64-request mixed load. Computed once per
    run by the first worker that starts an end-to-end test, beside that test (the first tests,
    one FFN role that waits and attention roles started one after another, leave a core idle),
    and written to ``answers_path``, where every worker reads it."""

    WAIT_S = 900

    def __init__(self, models: dict[str, Path], logs: Path, answers_path: Path, compute: bool):
        self.path, self.failed = answers_path, answers_path.with_suffix(".failed")
        self.procs: list[tuple[subprocess.Popen, Path]] = []
        self.start = time.monotonic()
        self._answers: dict[str, list] | None = None
        self.done = ""
        if compute:
            try:
                self._compute(models, logs)
            except BaseException:
                self.failed.write_text(f"colocated reference failed to start:\n"
                                       f"{traceback.format_exc()}")
                raise

    def _compute(self, models: dict[str, Path], logs: Path) -> None:
        jobs = [{"key": arch, "model": str(models[arch]), "prompts": PROMPTS[:NUM_PROMPTS],
                 "max_tokens": [32] * NUM_PROMPTS} for arch in ARCHS]
        jobs += [{"key": f"{arch}-{RIDE_THROUGH_TOKENS}", "model": str(models[arch]),
                  "prompts": PROMPTS[:NUM_PROMPTS],
                  "max_tokens": [RIDE_THROUGH_TOKENS] * NUM_PROMPTS}
                 for arch in RIDE_THROUGH_ARCHS]
        mixed = mixed_load()
        jobs.insert(1, {"key": "deepseek_v2-mixed", "model": str(models["deepseek_v2"]),
                        "prompts": [p for p, _ in mixed], "max_tokens": [n for _, n in mixed]})
        script = Path(__file__).with_name("colocated_reference.py")
        for core in (0, 1):
            share, out = logs / f"colocated-jobs-{core}.json", logs / f"colocated-{core}.json"
            share.write_text(json.dumps(jobs[core::2]))
            log = open(logs / f"colocated-{core}.log", "wb")  # noqa: SIM115 - the child's
            env = {**os.environ, **BASE_ENV, "VLLM_CPU_OMP_THREADS_BIND": str(core)}
            self.procs.append((subprocess.Popen(
                [sys.executable, str(script), str(share), str(out)], stdout=log,
                stderr=subprocess.STDOUT, env=env), out))
            log.close()
        threading.Thread(target=self._collect, args=(len(jobs),), daemon=True).start()

    def _collect(self, num_jobs: int) -> None:
        """Wait for both processes, then publish their answers or why there are none: a reader
        must never wait out its bound for a reference that failed."""
        try:
            answers: dict[str, list] = {}
            for proc, out in self.procs:
                rc = proc.wait()
                if rc != 0:
                    self.failed.write_text(f"colocated reference failed ({rc}):\n" + "\n".join(
                        out.with_suffix(".log").read_text(errors="replace").splitlines()[-40:]))
                    return
                answers.update(json.loads(out.read_text()))
            answers["deepseek_v2-mixed"] = [a["tokens"] for a in answers["deepseek_v2-mixed"]]
            # Said by answers(), in the test's thread: pytest's capture is not this thread's.
            self.done = (f"colocated references for {num_jobs} jobs done "
                         f"{time.monotonic() - self.start:.0f} s after they started")
            partial = self.path.with_suffix(".partial")
            partial.write_text(json.dumps(answers))
            os.replace(partial, self.path)  # readers never see half a file
        except BaseException:
            self.failed.write_text(f"colocated reference failed:\n{traceback.format_exc()}")
            raise

    def answers(self) -> dict[str, list]:
        end = time.monotonic() + self.WAIT_S
        while self._answers is None:
            if self.path.exists():
                self._answers = json.loads(self.path.read_text())
                if self.done:
                    say(self.done)
            elif self.failed.exists():
                raise AssertionError(self.failed.read_text())
            elif time.monotonic() > end:
                raise AssertionError(f"no colocated reference in {self.path} after "
                                     f"{self.WAIT_S} s")
            else:
                time.sleep(0.5)
        return self._answers

    def close(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session", autouse=True)
def _colocated_reference(models, logs, tmp_path_factory):
    path = run_dir(tmp_path_factory) / "colocated-answers.json"
    try:  # the first worker to get here computes it
        os.close(os.open(path.with_suffix(".claim"), os.O_CREAT | os.O_EXCL))
        first = True
    except FileExistsError:
        first = False
    reference = ColocatedReference(models, logs, path, compute=first)
    yield reference
    reference.close()


@pytest.fixture(scope="session")
def colocated(_colocated_reference) -> dict[str, list]:
    return _colocated_reference.answers()


class Pair:
    """Both roles' servers: per role one ``vllm serve`` for all its DP ranks, or (on hosts) one
    per rank, rank 0 the front end and the others headless."""

    def __init__(self, ffn: list[Server], attention: list[Server], port: int):
        self.ffn_ranks, self.attention_ranks = ffn, attention
        self.port = port  # the AFD rendezvous
        self.apart_s: float | None = None  # (started one role first) from its ready to both

    @property
    def ffn(self) -> Server:
        return self.ffn_ranks[0]

    @property
    def attention(self) -> Server:
        return self.attention_ranks[0]

    @property
    def servers(self):
        return (*self.ffn_ranks, *self.attention_ranks)


def dp_args(ranks: int) -> list[str]:
    return ["--data-parallel-size", str(ranks)] if ranks > 1 else []


# A headless DP rank starts no API server, and vLLM refuses an API-server count with --headless.
HEADLESS_COMMON_ARGS = [a for i, a in enumerate(COMMON_ARGS)
                        if "--api-server-count" not in COMMON_ARGS[max(i - 1, 0):i + 1]]


def role_servers(role: str, name: str, model: Path, logs: Path, ranks: int, args: list[str],
                 env: dict, cores: list[str], hosts: Hosts | None = None,
                 first_host: int = 0) -> list[Server]:
    """One role's servers. Without ``hosts``: one ``vllm serve`` with ``--data-parallel-size``.
    With ``hosts``: DP rank r on host ``first_host + r`` through vLLM's multi-node flags (rank 0
    serves HTTP and leads the DP group at its address; the others run ``--headless`` from
    ``--data-parallel-start-rank r``)."""
    if hosts is None:
        return [Server(f"{name}-{role}", str(model), free_port(), logs / f"{name}-{role}.log",
                       args=args + dp_args(ranks), env=dict(env), cores="|".join(cores))]
    lead, rpc_port = hosts.address(first_host), free_port()
    out = []
    for r in range(ranks):
        h = first_host + r
        dp = (["--data-parallel-size", str(ranks), "--data-parallel-size-local", "1",
               "--data-parallel-address", lead, "--data-parallel-rpc-port", str(rpc_port)]
              if ranks > 1 else [])
        if r:
            dp += ["--headless", "--data-parallel-start-rank", str(r)]
        out.append(Server(f"{name}-{role}{r}", str(model), free_port(),
                          logs / f"{name}-{role}{r}.log", args=args + dp,
                          env={**env, **hosts.env(h, ranks > 1)}, cores=cores[r],
                          host=hosts.address(h),
                          wrap=hosts.wrap(h),
                          common_args=list(HEADLESS_COMMON_ARGS if r else COMMON_ARGS)))
    return out


@contextlib.contextmanager
def afd_pair(name: str, logs: Path, attn_model: Path, ffn_model: Path | None = None,
             num_attention_ranks: int = 1, num_ffn_ranks: int = 1,
             vllm_args: tuple[str, ...] = (), env: dict | None = None,
             attention_args: tuple[str, ...] = (), hosts: Hosts | None = None,
             first: str | None = None, apart_s: float = 0.0, **afd):
    """Start an FFN and an attention `vllm serve`, wait until both are ready; afterwards stop
    whatever the test left running. With ``first`` ("attention" or "ffn") that role starts
    alone and must get ready alone; the other starts once it is, and no sooner than ``apart_s``
    after the first started (``pair.apart_s`` says how long the first then waited for the
    other). ``vllm_args`` and ``env`` go to both roles (e.g.
    ``--enable-expert-parallel``, ``AFD_TEST_INORDER``), ``attention_args`` to the attention role
    (e.g. ``--speculative-config``). With ``hosts`` every rank runs on a host of its own: the
    attention ranks on hosts 0.., the FFN ranks after them."""
    port = free_port()
    ranks = {"num_attention_ranks": num_attention_ranks, "num_ffn_ranks": num_ffn_ranks}
    if hosts is not None:
        afd.setdefault("host", hosts.address(num_attention_ranks))
    # FFN DP ranks start on core 1 and alternate, so 1A2F puts one FFN rank beside attention.
    # One core per DP rank for the attention role (it shares core 1 with the FFN role then).
    ffn = role_servers("ffn", name, ffn_model or attn_model, logs, num_ffn_ranks,
                       afd_args("ffn", port, **ranks, **afd) + list(vllm_args), env or {},
                       [str((i + 1) % 2) for i in range(num_ffn_ranks)], hosts,
                       first_host=num_attention_ranks)
    attention = role_servers("attention", name, attn_model, logs, num_attention_ranks,
                             afd_args("attention", port, **ranks, **afd) + list(vllm_args)
                             + list(attention_args), env or {},
                             [str(i % 2) for i in range(num_attention_ranks)], hosts)
    pair = Pair(ffn, attention, port)
    try:
        if first is not None:
            early, late = (attention, ffn) if first == "attention" else (ffn, attention)
            start = time.monotonic()
            for server in early:
                server.start()
            early[0].wait_ready(progress=say, others=tuple(early[1:]))
            ready_alone = time.monotonic()
            say(f"{name}: the {first} role is ready alone after {ready_alone - start:.0f} s")
            time.sleep(max(0.0, start + apart_s - time.monotonic()))
            for server in late:
                server.start()
        else:
            for server in pair.servers:
                server.start()
        headless = pair.servers[1:len(ffn)] + pair.servers[len(ffn) + 1:]
        pair.attention.wait_ready(progress=say, others=(pair.ffn, *headless))
        pair.ffn.wait_ready(progress=say, others=(pair.attention, *headless))
        if first is not None:
            pair.apart_s = time.monotonic() - ready_alone
        yield pair
    finally:
        for server in pair.servers:
            server.signal()
        wait_gone(pair.servers, 30)
        for server in pair.servers:
            server.stop(timeout_s=1)
