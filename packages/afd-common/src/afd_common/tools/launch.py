"""Starting and stopping ``vllm serve`` processes for the demo, the benchmark and the tests.

Each server runs in a session of its own, so it can be stopped as a whole and checked for orphans;
its output goes to a log file, and ``wait_ready`` reports progress while it loads.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# Two vLLM processes on a small machine: keep each on its own cores (PLATFORM: otherwise both land
# on core 0), use the V1 runner, and let the CPU engine take only part of RAM.
BASE_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_LOGGING_LEVEL": "INFO", "TOKENIZERS_PARALLELISM": "false"}
# One API server also under DP (vLLM starts one per DP rank by default): on 2 cores every extra
# process slows the start of both roles. A KV cache sized for the load (64 x 512 tokens fit in
# 512 MiB for every tiny model) rather than a quarter of RAM per server: less to allocate at each
# start, and room for the many processes of DP roles.
COMMON_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
               "--kv-cache-memory-bytes", str(512 * 2**20), "--seed", "0", "--max-num-seqs", "64",
               "--api-server-count", "1"]


def cpu_backend_args(model: str) -> list[str]:
    """Flags a model needs on CPU beyond COMMON_ARGS: on a CPU with AMX, vLLM's MLA backend of
    choice (AMX_MLA) packs 16-bit weights only and fails to load float32 ones, so MLA checkpoints
    take the reference CPU MLA backend, the one vLLM picks on every other CPU anyway."""
    config = Path(model) / "config.json"
    if config.is_file() and "kv_lora_rank" in json.loads(config.read_text()):
        return ["--attention-backend", "CPU_MLA"]
    return []


def vllm_executable() -> str:
    exe = Path(sys.executable).with_name("vllm")
    return str(exe) if exe.exists() else (shutil.which("vllm") or "vllm")


def afd_args(role: str, afd_port: int, **afd) -> list[str]:
    section = {"role": role, "connector": "P2pAFDConnector", "host": "127.0.0.1",
               "port": afd_port, "num_attention_ranks": 1, "num_ffn_ranks": 1, **afd}
    return ["--additional-config", json.dumps({"afd": section})]


@dataclass
class Server:
    name: str
    model: str
    http_port: int
    log_path: Path
    args: list[str] = field(default_factory=list)
    cores: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "1" or "0|1"
    env: dict[str, str] = field(default_factory=dict)
    common_args: list[str] = field(default_factory=lambda: list(COMMON_ARGS))
    host: str = "127.0.0.1"  # the address it serves HTTP on
    # A command prefix it runs under, e.g. ``ip netns exec NAME`` for a host in a namespace.
    wrap: list[str] = field(default_factory=list)
    device: str = "cpu"  # "cuda": no CPU-only flags
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def start(self) -> Server:
        env = {**os.environ, **BASE_ENV, **self.env}
        if self.cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cores
        cmd = [*self.wrap, vllm_executable(), "serve", self.model, "--port", str(self.http_port),
               "--host", self.host, *self.common_args, *self.args,
               *(cpu_backend_args(self.model) if self.device == "cpu" else [])]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        return self

    def health(self) -> int:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (OSError, urllib.error.URLError):
            return 0

    def exited(self) -> bool:
        return self.proc is None or self.proc.poll() is not None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def wait_ready(self, timeout_s: float = 300, progress=None, others=()) -> None:
        """Until /health is 200. Raises with the log tail if the server (or one of ``others``,
        e.g. its AFD peer) exits first or the time runs out."""
        start = time.monotonic()
        last = start
        while True:
            if self.health() == 200:
                return
            for server in (self, *others):
                if server.exited():
                    raise RuntimeError(f"{server.name} exited with {server.proc.returncode} "
                                       f"before {self.name} was ready:\n{server.log_tail()}")
            now = time.monotonic()
            if now - start > timeout_s:
                raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f} s:\n"
                                   f"{self.log_tail()}")
            if progress and now - last >= 5:
                progress(f"{self.name}: loading ({now - start:.0f} s)")
                last = now
            time.sleep(0.5)

    def pids(self) -> list[int]:
        """Every live process of this server's session (the server and all it spawned)."""
        if self.proc is None:
            return []
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                state, sid = fields[0], int(fields[3])
            except (OSError, ValueError, IndexError):
                continue
            if sid == self.proc.pid and state != "Z":
                out.append(int(entry.name))
        return out

    def weights(self) -> dict[int, dict]:
        """Every worker's ``AFD weights:`` log line (one per DP rank), by rank: the parameters
        it holds by category (``afd_common.vllm_glue.model.weight_summary``)."""
        out = {}
        for line in self.log_path.read_text(errors="replace").splitlines():
            if "AFD weights:" in line:
                entry = json.loads(line.split("AFD weights:", 1)[1])
                out[entry.get("ffn_rank", 0)] = entry["by_category"]
        return out

    def rss_bytes(self) -> int:
        total = 0
        for pid in self.pids():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 30) -> bool:
        """SIGTERM the server, then SIGKILL whatever of its session remains after the timeout.
        True when everything ended by itself in time."""
        if self.proc is None:
            return True
        self.signal(signal.SIGTERM)
        clean = wait_gone([self], timeout_s)
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        return clean


def wait_gone(servers, timeout_s: float) -> bool:
    """True when no process of any of ``servers`` is left within ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for s in servers:
            if s.proc is not None:
                s.proc.poll()  # reap the leader
        if not any(s.pids() for s in servers):
            for s in servers:  # a leader that exited since the poll: its exit code is set
                if s.proc is not None:
                    s.proc.wait(timeout=5)
            return True
        time.sleep(0.25)
    return False


def complete(server: Server, prompts: list[str], max_tokens: int = 32,
             timeout_s: float = 600) -> list[dict]:
    """Greedy completions with logprobs, as token ids: one request, every prompt in it."""
    body = json.dumps({"model": server.model, "prompt": prompts, "max_tokens": max_tokens,
                       "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True,
                       "ignore_eos": True, "seed": 0}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out = json.loads(r.read())
    choices = sorted(out["choices"], key=lambda c: c["index"])
    return [{"text": c["text"], "tokens": c["logprobs"]["tokens"],
             "logprobs": c["logprobs"]["token_logprobs"]} for c in choices]


_WORDS = "alpha beta gamma delta river stone cloud light north seven".split()


def load(server: Server, count: int, start: int = 0, concurrency: int = 8,
         max_tokens: int = 8) -> float:
    """``count`` greedy requests of a few words each (request ``i`` for ``i`` from ``start``),
    ``concurrency`` at a time; the seconds they took. Raises if any failed."""
    def one(i: int) -> int:
        prompt = " ".join(_WORDS[(i * 3 + j) % 10] for j in range(1 + i % 7))
        body = json.dumps({"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(server.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            json.loads(r.read())
            return r.status

    t = time.monotonic()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        statuses = list(pool.map(one, range(start, start + count)))
    bad = [s for s in statuses if s != 200]
    if bad:
        raise RuntimeError(f"{len(bad)} of {count} requests failed: {bad[:5]}")
    return time.monotonic() - t


def compare(a: list[dict], b: list[dict], tol: float = 1e-3) -> list[str]:
    """Differences between two answer lists: token mismatches, logprobs beyond ``tol``."""
    problems = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x["tokens"] != y["tokens"]:
            first = next(j for j, (s, t) in enumerate(zip(x["tokens"], y["tokens"])) if s != t)
            problems.append(f"prompt {i}: tokens differ from position {first}")
            continue
        worst = max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"]))
        if worst > tol:
            problems.append(f"prompt {i}: logprob differs by {worst:.2e}")
    return problems


PROMPTS = [
    "The quick brown fox", "Once upon a time", "In the beginning the river",
    "Mixture of experts models route", "The weather today is", "A small robot learned",
    "Paris is the capital of", "The recipe needs flour and", "Every morning the baker",
    "Attention is all you", "The mountain path turned", "Numbers can be added",
    "She opened the old book and", "The train left the station", "Water boils at",
    "My favourite colour is", "The cat sat on the", "Long ago in a distant",
    "Engineers measure twice and", "Stars appear when the",
]


def free_port() -> int:
    """A port free now, from below the kernel's ephemeral range: the port is bound later by
    another process, and a port the kernel hands out (bind to 0) could meanwhile be handed to
    someone else -- vLLM, ZMQ and Gloo take many ephemeral ports while a role starts."""
    import random

    low = 32768
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(200):
        port = random.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
