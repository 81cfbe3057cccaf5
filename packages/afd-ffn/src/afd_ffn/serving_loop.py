"""What both FFN serving loops share: serve until told to stop, and count what was served for
``/health``."""

from __future__ import annotations

import abc
import time
from collections.abc import Callable

import torch

from afd_common import metrics
from afd_common.contract import FFNConnector
from afd_common.metadata import WorkItem

ComputeFn = Callable[[WorkItem], torch.Tensor]


class ServingLoop(abc.ABC):
    """``compute(item)`` returns the expert output for ``item`` (same rows, same dtype)."""

    def __init__(self, connector: FFNConnector, compute: ComputeFn):
        self.connector = connector
        self.compute = compute
        self.metrics = metrics.recorder("ffn", connector.config.connector)
        self._timer = metrics.DeviceTimer(connector.device)
        self.steps_done = 0
        self.last_step_at: float | None = None

    def _receive(self, recv: Callable[..., WorkItem], *args) -> WorkItem:
        start = time.perf_counter()
        item = recv(*args)
        self.metrics.wait(time.perf_counter() - start)
        return item

    def _answer(self, item: WorkItem) -> None:
        """Experts for the item's rows, then the result back (an empty item gets an empty one:
        the attention side waits for every stage it sent, even one without rows)."""
        rec = self.metrics
        rec.routed(self.connector.local_rank, item.num_tokens)
        if item.num_tokens:
            start = self._timer.start()
            out = self.compute(item)
            self._timer.stop(start, rec.ffn_compute)
        else:
            out = item.hidden_states.new_empty(0, item.hidden_states.shape[1])
        self.connector.send_ffn_output(out, item)
        rec.moved(sent=metrics.nbytes(out), received=metrics.nbytes(
            item.hidden_states, item.topk_ids, item.topk_weights))

    @abc.abstractmethod
    def run_step(self) -> bool:
        """Serve one unit (a step, or a work item). False once the attention side stopped."""

    def _served(self) -> bool:
        self.connector.end_step()
        self.steps_done += 1
        self.last_step_at = time.monotonic()
        return True

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> int:
        """Serve until the attention side stops (or ``should_stop``). Returns units served."""
        while not should_stop() and self.run_step():
            pass
        return self.steps_done
