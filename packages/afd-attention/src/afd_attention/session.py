"""One attention rank's AFD session: its connector and the step it is in.

A step begins lazily at the first MoE layer of a forward and ends after the last one (of the last
micro-batch with rows), so every forward vLLM runs once the server is up -- real steps and the
dummy batches of idle DP ranks -- announces itself to the FFN side with its exact token counts.

The roles start in any order, any time apart: the connector connects in a thread of its own, and
vLLM's start-up forwards (profile run, compilation, graph capture: their outputs are thrown away)
run before it has, with the routed experts' output zeros -- the same on every attention rank, so
the FFN side's first step is everyone's first real one. A step that finds the FFN role not
connected yet waits for it (progress in the log; ``connect_timeout_s`` bounds it).

The session also knows whether a step is running when the FFN role is lost: a running step fails
by itself (its receive raises), so only an idle worker must be ended from outside
(afd_common.lifecycle).
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from afd_common import metrics
from afd_common.config import AFDConfig
from afd_common.contract import AttentionConnector
from afd_common.errors import AFDError, AFDPeerError
from afd_common.lifecycle import mark_failed
from afd_common.metadata import LayerCall, StepKind, StepMetadata
from afd_common.transport import CONNECT_PROGRESS_EVERY_S
from afd_common.vllm_model import layer_index

from afd_attention import micro_batches

logger = logging.getLogger("vllm.afd")

_current: AttentionSession | None = None


def current() -> AttentionSession:
    if _current is None:
        raise RuntimeError("AFD attention session is not initialised: the model ran before the "
                           "AFD attention worker connected to its FFN role")
    return _current


class AttentionSession:
    """Runs each MoE layer's remote call for every micro-batch stage of the step.

    The runner announces a split step with ``plan(stage_tokens)``; an unsplit forward (any
    dummy, profile or warm-up run, or a step with one request) is stage 0 with every other
    stage empty. Empty stages are exchanged like any other (no rows), so the FFN side serves
    every stage of every layer the same way whatever each attention rank's split.
    """

    def __init__(self, config: AFDConfig, connector: AttentionConnector):
        self.config = config
        self.connector = connector
        self.gate_on_attention = config.compute_gate_on_attention
        self.num_stages = config.extra.num_micro_batches
        self.first_layer = connector.shape.moe_layers[0]
        self.last_layer = connector.shape.moe_layers[-1]
        self.metrics = metrics.recorder("attention", config.connector)
        self.step = 0
        self._layer_of: dict[str, int] = {}
        self._lock = threading.Lock()
        self._in_step = False
        self._lost: str | None = None
        self._planned: tuple[int, ...] | None = None
        self._last_busy = 0
        self._since: list[float | None] = [None] * self.num_stages
        self.closed = False
        self._serving = False  # vLLM's start-up is over: forwards need the FFN role
        self._peers = threading.Event()  # connected, or lost (then _lost says why)

    def startup_done(self) -> None:
        """vLLM finished its start-up forwards; from now on every forward is a step. A connection
        that failed meanwhile fails the start-up here, through vLLM's own path for a worker that
        cannot start (ending the worker from outside mid-start-up leaves the server hanging)."""
        with self._lock:
            self._serving = True
            self._raise_if_lost()

    def connected(self) -> None:
        self._peers.set()

    def activate(self) -> None:
        global _current
        _current = self

    def plan(self, stage_tokens: tuple[int, ...]) -> None:
        """The next forward is split: its tokens per stage."""
        self._planned = stage_tokens

    def stage_started(self, stage: int) -> None:
        """A stage's forward begins: its first attention compute starts now."""
        self._since[stage] = time.perf_counter()

    def remote_experts(self, layer_name: str, x: torch.Tensor, topk_weights, topk_ids):
        if not self._serving:
            return torch.zeros_like(x)  # a start-up forward: its output is thrown away
        layer = self._layer_of.get(layer_name)
        if layer is None:
            layer = self._layer_of[layer_name] = layer_index(layer_name)
        stage = micro_batches.current_stage()
        conn, rec = self.connector, self.metrics
        try:
            if layer == self.first_layer and stage == 0:
                self._begin_step(x.shape[0])
            call = LayerCall(layer, stage)
            sent = time.perf_counter()
            if self._since[stage] is not None:  # None in forwards the runner did not time
                rec.attention_compute(sent - self._since[stage])
            conn.send_attn_output(x.contiguous(), call, topk_ids, topk_weights)
            empty = range(stage + 1, self.num_stages) if stage == self._last_busy else ()
            for s in empty:
                conn.send_attn_output(*self._empty_rows(x), LayerCall(layer, s),
                                      *self._empty_routing(topk_ids, topk_weights))
            micro_batches.hand_over()  # the next stage's attention overlaps our experts
            waiting = time.perf_counter()
            out = conn.recv_ffn_output(call)
            for s in empty:
                conn.recv_ffn_output(LayerCall(layer, s))
            done = self._since[stage] = time.perf_counter()
            rec.wait(done - waiting)
            rec.roundtrip(done - sent)
            rec.moved(sent=metrics.nbytes(x, topk_ids, topk_weights), received=metrics.nbytes(out))
            if layer == self.last_layer and stage == self._last_busy:
                conn.end_step()
                self.step += 1
                self._since = [None] * self.num_stages
                with self._lock:
                    self._in_step = False
        except AFDError as e:
            mark_failed(f"step {self.step}, layer {layer}, micro-batch {stage}: {e}")
            raise
        return out

    def _begin_step(self, rows: int) -> None:
        with self._lock:
            self._raise_if_lost()
            self._in_step = True
        if not self._peers.is_set():
            self._wait_for_peers()
        tokens = self._planned or (rows,) + (0,) * (self.num_stages - 1)
        self._planned = None
        self._last_busy = max((s for s, n in enumerate(tokens) if n), default=0)
        self.connector.begin_step(StepMetadata(self.step, StepKind.RUN, tokens))

    def _wait_for_peers(self) -> None:
        c, start = self.config, time.monotonic()
        while not self._peers.wait(CONNECT_PROGRESS_EVERY_S):
            logger.info("AFD attention: step %d waits for the FFN role at %s:%d (%.0f s; "
                        "connect_timeout_s %s)", self.step, c.host, c.port,
                        time.monotonic() - start, c.extra.connect_timeout_s or "unset")
        with self._lock:
            self._raise_if_lost()

    def _raise_if_lost(self) -> None:
        """Under ``_lock``: the one place a recorded loss becomes the caller's error."""
        if self._lost is not None:
            raise AFDPeerError(self._lost)

    def _empty_rows(self, like: torch.Tensor) -> tuple[torch.Tensor]:
        return (like.new_empty(0, like.shape[1]),)

    def _empty_routing(self, topk_ids, topk_weights) -> tuple:
        if topk_ids is None:
            return (None, None)
        k = topk_ids.shape[1]
        return (topk_ids.new_empty(0, k), topk_weights.new_empty(0, k))

    def peer_lost(self, reason: str) -> str:
        """Record that the FFN role is gone; no step starts after this. Says who must act:
        "starting" (vLLM's start-up will fail with it: ``startup_done`` raises), "in_step" (the
        running step raises by itself) or "idle" (nothing would raise: the caller must end the
        worker)."""
        with self._lock:
            self._lost = reason
            self._peers.set()  # a step waiting for the connection raises
            if not self._serving:
                return "starting"
            return "in_step" if self._in_step else "idle"

    def close(self) -> None:
        global _current
        self.closed = True
        if _current is self:
            _current = None
        self.connector.close()
