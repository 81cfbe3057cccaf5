"""The FFN role's serving loop, in a thread of the FFN worker.

vLLM's worker keeps answering its engine's calls (start-up, status) on its main thread while this
thread connects to the attention role and runs the sync runner (or, for connectors without a
control plane, the async runner) until the attention role stops.
When the loop ends the whole FFN server goes down with it: an FFN role without its attention role
has nothing to do. After a STOP the server is stopped normally; after a failure this worker ends,
so vLLM fails the engine -- which also works while vLLM is still starting up, when a stop signal
to the server would be swallowed (afd_common.lifecycle).
"""

from __future__ import annotations

import logging
import threading
import time

from afd_common.config import AFDConfig
from afd_common.errors import AFDError
from afd_common import lifecycle
from afd_common.metadata import ModelShape
from afd_common.model_thread import enter_model_thread
from afd_common.registry import resolve_connector

from afd_ffn.async_runner import AsyncFFNRunner
from afd_ffn.sync_runner import SyncFFNRunner

logger = logging.getLogger("vllm.afd")


class FFNService:
    def __init__(self, config: AFDConfig, rank: int, shape: ModelShape, compute, device,
                 vllm_config=None):
        self.config, self.rank, self.shape = config, rank, shape
        self.vllm_config = vllm_config
        self.compute = compute
        self.device = device
        self.state = "starting"
        self.error: str | None = None
        self.runner: SyncFFNRunner | AsyncFFNRunner | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"afd-ffn-{rank}", daemon=True)
        self.connector = resolve_connector(config.connector, "ffn")(config, rank, shape, device)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            enter_model_thread(self.vllm_config, self.device)
            self.state = "connecting"
            logger.info("AFD FFN rank %d: waiting for the attention role on %s:%d",
                        self.rank, self.config.host, self.config.port)
            self.connector.init()
            self.state = "serving"
            logger.info("AFD FFN rank %d: connected; serving %d MoE layers", self.rank,
                        len(self.shape.moe_layers))
            # Connectors without a control plane carry the layer index in their data: the
            # receive loop is the clock.
            runner_cls = (SyncFFNRunner if self.connector.control_plane is not None
                          else AsyncFFNRunner)
            self.runner = runner_cls(self.connector, self.compute)
            steps = self.runner.run(self._stop.is_set)
            self.state = "stopped"
            if not self._stop.is_set():
                lifecycle.stop_server(f"FFN rank {self.rank}: the attention role stopped "
                                      f"after {steps} steps")
        except BaseException as e:  # noqa: BLE001 - reported through /health and the log
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            if not self._stop.is_set():
                if not isinstance(e, AFDError):
                    logger.exception("AFD FFN rank %d: unexpected error", self.rank)
                lifecycle.mark_failed(f"FFN rank {self.rank} failed: {self.error}")
                lifecycle.exit_worker()
        finally:
            self.connector.close()

    def status(self) -> dict:
        runner = self.runner
        return {"rank": self.rank, "state": self.state,
                "healthy": self.state in ("connecting", "serving"),
                "steps": runner.steps_done if runner else 0,
                "seconds_since_last_step": (round(time.monotonic() - runner.last_step_at, 3)
                                            if runner and runner.last_step_at else None),
                "error": self.error}

    def stop(self) -> None:
        self._stop.set()
        self.connector.close()
