"""The benchmark load: fixed token-id prompts, streamed through ``/v1/completions``.

Prompts are token ids (exact length, the same for every configuration) drawn from a seeded
generator; each request asks for exactly ``output_len`` tokens (``ignore_eos``, greedy). The
server streams one chunk per step with its token ids (``return_token_ids``), so each token's
arrival time is known on the client.

Why not ``vllm bench serve``: its per-request start times, TTFTs and ITLs (``--save-detailed``)
would give the same arrival times, but afd-bench also needs what it cannot do -- run code at
the instant every request of a batch has its first token (the roles' ``/metrics`` are scraped
there, so the per-role breakdown is of decode steps only), send the same token ids to every
configuration (its random dataset sends text, re-tokenized by each server), and measure 20
loads in one process without starting a client for each.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from afd_common.tools.bench.stats import RequestTiming

FIRST_ID = 16  # past the tokenizer's special tokens


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, vocab) for _ in range(length)] for _ in range(count)]


def stream_request(url: str, model: str, prompt: list[int], max_tokens: int,
                   timeout_s: float, on_tokens=None) -> RequestTiming:
    body = json.dumps({
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "return_token_ids": True,
    }).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    timing = RequestTiming(t_send=time.perf_counter(), t_end=0.0)
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for raw in resp:
            now = time.perf_counter()
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"server error in stream: {chunk['error']}")
            n = sum(len(c.get("token_ids") or []) for c in chunk.get("choices") or [])
            if n:
                timing.arrivals.append((now, n))
                if on_tokens:
                    on_tokens(n)
    timing.t_end = time.perf_counter()
    if timing.tokens != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {timing.tokens}")
    return timing


class Progress:
    """Tokens received, as a tqdm bar on stderr (a plain line every few seconds without tqdm)."""

    def __init__(self, total: int, desc: str):
        self._lock = threading.Lock()
        self._done, self._total, self._desc, self._last = 0, total, desc, time.monotonic()
        try:
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, leave=False,
                             dynamic_ncols=True)
        except ImportError:
            self._bar = None

    def __call__(self, n: int) -> None:
        with self._lock:
            self._done += n
            if self._bar is not None:
                self._bar.update(n)
            elif time.monotonic() - self._last >= 5:
                self._last = time.monotonic()
                print(f"  .. {self._desc}: {self._done}/{self._total} tokens", file=sys.stderr,
                      flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run_batch(url: str, model: str, prompts: list[list[int]], max_tokens: int,
              timeout_s: float = 600, desc: str = "",
              on_decoding=None) -> tuple[float, list[RequestTiming]]:
    """All prompts at once, one streamed request each. Returns (wall seconds, timings).
    ``on_decoding()`` runs once every request has its first token (every prefill is done), in a
    thread of its own, and is over when this returns."""
    progress = Progress(len(prompts) * max_tokens, desc)
    start = threading.Barrier(len(prompts))
    lock, started, hook = threading.Lock(), [0], []

    def one(prompt):
        first = [True]

        def on_tokens(n):
            progress(n)
            if first[0] and on_decoding is not None:
                first[0] = False
                with lock:
                    started[0] += 1
                    if started[0] == len(prompts):
                        hook.append(threading.Thread(target=on_decoding, daemon=True))
                        hook[0].start()
        start.wait()
        return stream_request(url, model, prompt, max_tokens, timeout_s, on_tokens)

    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            timings = list(pool.map(one, prompts))
    finally:
        progress.close()
        for thread in hook:
            thread.join()
    wall = max(t.t_end for t in timings) - min(t.t_send for t in timings)
    return wall, timings


def scrape(url: str, timeout_s: float = 10) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as resp:
        return resp.read().decode("utf-8", errors="replace")
