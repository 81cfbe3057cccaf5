"""The FFN role's serving loop, in a thread of the FFN worker: a service that outlives its
attention roles.

vLLM's worker keeps answering its engine's calls (start-up, status) on its main thread while this
thread waits for an attention world, serves it with the scheduled loop (or, for connectors without
a control plane, the streaming loop) and, when that world ends -- stopped, crashed, restarted, or
refused at the handshake -- closes its connector and waits for the next one. The FFN role holds
no per-request state, so whichever attention world completes the handshake next (same model
fingerprint and token) is served from its first step. It ends only when stopped, or on a failure
of its own (afd_common.vllm_glue.lifecycle), or when ``connect_timeout_s`` is set and no
attention role turned up within it.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

from afd_common.config import AFDConfig
from afd_common.contract import ScheduledFFNConnector
from afd_common.errors import AFDError, AFDRendezvousClosingError, AFDTimeoutError
from afd_common.vllm_glue import lifecycle, role_status
from afd_common.metadata import ModelShape
from afd_common.vllm_glue.model_thread import enter_model_thread
from afd_common.registry import resolve_connector

from afd_ffn.streaming_loop import StreamingLoop
from afd_ffn.scheduled_loop import ScheduledLoop

logger = logging.getLogger("vllm.afd")

# After a world ended badly, before waiting for the next: FFN ranks other than 0 must not find
# rank 0's old rendezvous still up, and a role that keeps failing must not spin.
NEXT_WORLD_PAUSE_S = 2.0
# How often a serving rank refreshes what ``/health`` reads (its step count and last step); state
# changes are published at once.
PUBLISH_EVERY_S = 1.0
# What forming a world says while rank 0's last rendezvous is still closing, besides
# AFDRendezvousClosingError (found it still up): rank 0 cannot re-bind yet, or it went mid-way.
_OLD_WORLD_CLOSING = ("Address already in use", "lost the rendezvous")


class FFNService:
    def __init__(self, config: AFDConfig, rank: int, shape: ModelShape, compute, device,
                 vllm_config=None):
        self.config, self.rank, self.shape = config, rank, shape
        self.vllm_config = vllm_config
        self.compute = compute
        self.device = device
        self._state = "starting"
        self.error: str | None = None  # why the last attention world ended, if not by a stop
        self.worlds = 0
        self.loop: ScheduledLoop | StreamingLoop | None = None
        self._steps_before = 0  # served in earlier worlds
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._publishing = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"afd-ffn-{rank}", daemon=True)
        self.connector = self._new_connector()  # bad config fails here, in load_model

    def _new_connector(self):
        return resolve_connector(self.config.connector, "ffn")(self.config, self.rank,
                                                               self.shape, self.device)

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        self._state = value
        self._publish()

    def _publish(self) -> None:
        """What this rank's server's ``/health`` reads (afd_common.vllm_glue.role_status). Under
        a lock: the refresh thread's status, taken before a state change, must not land after
        it."""
        with self._publishing:
            status = self.status()
            since = status.pop("seconds_since_last_step")
            status["last_step_at"] = None if since is None else time.time() - since
            role_status.publish("ffn", self.rank, status)

    def start(self) -> None:
        self._publish()
        self._thread.start()
        threading.Thread(target=self._publish_loop, name=f"afd-ffn-status-{self.rank}",
                         daemon=True).start()

    def _publish_loop(self) -> None:
        while not self._stop.wait(PUBLISH_EVERY_S):
            if self._state == "serving":
                self._publish()

    def _run(self) -> None:
        try:
            enter_model_thread(self.vllm_config, self.device)
            while not self._stop.is_set():
                self._serve_one_world()
        except BaseException as e:  # noqa: BLE001 - reported through /health and the log
            self.error = f"{type(e).__name__}: {e}"
            self.state = "failed"
            if not self._stop.is_set():
                if not isinstance(e, AFDError):
                    logger.exception("AFD FFN rank %d: unexpected error", self.rank)
                lifecycle.mark_failed(f"FFN rank {self.rank} failed: {self.error}")
                lifecycle.exit_worker()

    def _serve_one_world(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            if self.connector is None:
                self.connector = self._new_connector()
            connector = self.connector
        c = self.config
        pause = 0.0
        self.state = "waiting"
        logger.info("AFD FFN rank %d: waiting for the attention role on %s:%d", self.rank,
                    c.host, c.port)
        try:
            connector.init()
            self.state = "serving"
            self.worlds += 1
            logger.info("AFD FFN rank %d: connected; serving %d MoE layers (attention world "
                        "%d)", self.rank, len(self.shape.moe_layers), self.worlds)
            loop_cls = (ScheduledLoop if isinstance(connector, ScheduledFFNConnector)
                          else StreamingLoop)
            self.loop = loop_cls(connector, self.compute)
            steps = self.loop.run(self._stop.is_set)
            self.error = None
            if not self._stop.is_set():
                logger.info("AFD FFN rank %d: the attention role stopped after %d steps; "
                            "waiting for the next one", self.rank, steps)
        except AFDError as e:
            if self._stop.is_set():
                return
            if (isinstance(e, AFDTimeoutError) and self.state == "waiting"
                    and c.extra.connect_timeout_s is not None):
                raise  # the bound the user asked for: no attention role turned up
            if self.state == "waiting" and (isinstance(e, AFDRendezvousClosingError) or any(
                    w in str(e) for w in _OLD_WORLD_CLOSING)):
                # Rank 0's last rendezvous is still up for a moment (its receives end as the
                # peers' connections close): this rank found it, or rank 0 cannot re-bind yet.
                logger.info("AFD FFN rank %d: the last attention world's rendezvous is still "
                            "closing; trying again", self.rank)
                pause = NEXT_WORLD_PAUSE_S / 4
            else:
                self.error = f"{type(e).__name__}: {e}"
                self._publish()
                logger.warning("AFD FFN rank %d: attention world ended: %s -- waiting for the "
                               "next attention role", self.rank, self.error)
                pause = NEXT_WORLD_PAUSE_S
        finally:
            with self._lock:
                if self.loop is not None:
                    self._steps_before += self.loop.steps_done
                    self.loop = None
                self.connector = None
            connector.close()
            # The closed world's store and groups may sit in reference cycles: free them now,
            # so rank 0's rendezvous port is free for the next world.
            gc.collect()
        # Only now, the error's traceback gone with the except block: its frames held the
        # refused world's store, so rank 0 kept that rendezvous up through the pause, and an
        # attention role arriving then found its ranks claimed there ("already taken").
        self._stop.wait(pause)

    def status(self) -> dict:
        loop = self.loop
        return {"rank": self.rank, "state": self._state,
                "healthy": self._state in ("starting", "waiting", "serving"),
                "steps": self._steps_before + (loop.steps_done if loop else 0),
                "attention_worlds": self.worlds,
                "seconds_since_last_step": (round(time.monotonic() - loop.last_step_at, 3)
                                            if loop and loop.last_step_at else None),
                "error": self.error}

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            connector = self.connector
        if connector is not None:
            connector.close()
