"""Micro-batch ping-pong inside one vLLM step, on CPU and CUDA alike.

A step's requests are split into ``m`` micro-batches on request boundaries. Each runs the model
forward in its own thread, but only the holder of a single baton runs: at every MoE layer the
holder sends its rows to the FFN role and hands the baton on *before* waiting for the result, so
micro-batch ``s+1`` computes its attention while the FFN role runs the experts of ``s``. Handing
over is cyclic, which is exactly the order the FFN role serves stages in (layer by layer, stage by
stage), so no receive ever waits for a send that has not been made.

vLLM's own micro-batching (DBO) needs CUDA streams and events and is switched off on CPU; this
needs neither. Because one thread runs model code at a time, vLLM's process-wide forward context
can be switched at every hand-over (vLLM's ubatching does the same), and each micro-batch sees
its own attention metadata.

Stage 0 runs on the calling thread; stages 1..m-1 on long-lived threads, so OpenMP thread teams
(which belong to the thread that starts them) are created once, not per step.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

_local = threading.local()


class MicroBatchAborted(RuntimeError):
    """Raised in a micro-batch when another one failed: its own work is moot."""


def split_on_requests(query_start_loc: np.ndarray, m: int) -> list[tuple[slice, slice]]:
    """(request slice, token slice) per micro-batch: at most ``m``, at least one request each,
    cuts only between requests and as close to equal token counts as the requests allow."""
    num_reqs = len(query_start_loc) - 1
    k = min(m, num_reqs)
    total = int(query_start_loc[-1])
    cuts = [0]
    for i in range(1, k):
        lo, hi = cuts[-1] + 1, num_reqs - (k - i)  # leave one request for every later part
        target = total * i / k
        cuts.append(min(range(lo, hi + 1), key=lambda j: abs(query_start_loc[j] - target)))
    cuts.append(num_reqs)
    return [(slice(a, b), slice(int(query_start_loc[a]), int(query_start_loc[b])))
            for a, b in zip(cuts, cuts[1:])]


def current_stage() -> int:
    """The micro-batch this thread runs (0 outside a pipeline)."""
    return getattr(_local, "stage", 0)


def hand_over() -> None:
    """Let the next micro-batch run until it hands the baton back; no-op outside a pipeline."""
    baton = getattr(_local, "baton", None)
    if baton is not None:
        baton.hand_over(_local.stage)


class _Baton:
    def __init__(self, n: int, on_resume: Callable[[int], None]):
        self._turn = [threading.Event() for _ in range(n)]
        self._done = [False] * n
        self._on_resume = on_resume
        self.all_done = threading.Event()
        self.error: BaseException | None = None

    def _next(self, me: int) -> int | None:
        n = len(self._done)
        for d in range(1, n + 1):
            s = (me + d) % n
            if not self._done[s]:
                return s
        return None

    def wait_turn(self, me: int) -> None:
        self._turn[me].wait()
        self._turn[me].clear()
        if self.error is not None:
            raise MicroBatchAborted(f"micro-batch {me}: another micro-batch failed")
        self._on_resume(me)

    def hand_over(self, me: int) -> None:
        nxt = self._next(me)
        if nxt == me:
            return
        self._turn[nxt].set()
        self.wait_turn(me)

    def finish(self, me: int, error: BaseException | None) -> None:
        if error is not None and self.error is None and not isinstance(error, MicroBatchAborted):
            self.error = error
        self._done[me] = True
        nxt = self._next(me)
        if nxt is None:
            self.all_done.set()
        else:
            self._turn[nxt].set()


class MicroBatchPipeline:
    """Runs one forward per micro-batch with the baton; the caller's thread runs stage 0."""

    def __init__(self, num_micro_batches: int, thread_setup: Callable[[], None] = lambda: None):
        """``thread_setup`` runs first in each micro-batch thread (device, vLLM config)."""
        self._queues: list[queue.SimpleQueue] = []
        for stage in range(1, num_micro_batches):
            q: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(stage, q, thread_setup), daemon=True,
                             name=f"afd-micro-batch-{stage}").start()
            self._queues.append(q)

    def run(self, forwards: Sequence[Callable[[], Any]],
            on_resume: Callable[[int], None]) -> list[Any]:
        """``forwards[s]()`` for every stage, interleaved at ``hand_over()``; ``on_resume(s)``
        runs whenever stage ``s`` gets the baton (and before it starts)."""
        n = len(forwards)
        if n - 1 > len(self._queues):
            raise ValueError(f"{n} micro-batches, but this pipeline has {len(self._queues) + 1}")
        baton = _Baton(n, on_resume)
        results: list[Any] = [None] * n
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        for s in range(1, n):
            self._queues[s - 1].put((baton, forwards[s], results, grad, inference))
        _local.stage, _local.baton = 0, baton
        error = None
        try:
            on_resume(0)
            results[0] = forwards[0]()
        except BaseException as e:  # noqa: BLE001 - handed to the baton, re-raised below
            error = e
        finally:
            _local.baton = None
            baton.finish(0, error)
        baton.all_done.wait()
        if baton.error is not None:
            raise baton.error
        return results

    @staticmethod
    def _serve(stage: int, q: queue.SimpleQueue, thread_setup: Callable[[], None]) -> None:
        thread_setup()
        _local.stage = stage
        while True:
            baton, forward, results, grad, inference = q.get()
            _local.baton = baton
            error = None
            try:
                baton.wait_turn(stage)
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    results[stage] = forward()
            except BaseException as e:  # noqa: BLE001 - the caller's thread re-raises it
                error = e
            finally:
                _local.baton = None
                baton.finish(stage, error)
