"""One attention rank's AFD session: its connector and the step it is in.

A step begins lazily at the first MoE layer of a forward and ends after the last one (of the last
micro-batch with rows), so every forward vLLM runs once the server is up -- real steps and the
dummy batches of idle DP ranks -- announces itself to the FFN side with its exact token counts.

The roles start in any order, any time apart: the connector connects in a thread of its own, and
vLLM's start-up forwards (profile run, compilation, graph capture: their outputs are thrown away)
run before it has, with the routed experts' output zeros -- the same on every attention rank, so
the FFN side's first step is everyone's first real one. A step that finds the FFN role not
connected yet waits for it (progress in the log; ``connect_timeout_s`` bounds it).

When the FFN role is lost after start-up, the session rides through it (``reconnect_timeout_s``,
0 switches it off): it closes the lost world once no step uses it, connects a new connector to
whichever FFN role turns up (a restarted one, or the same one after a network fault), and the
interrupted forward runs again from its start (``run_forward``). A forward is a pure function of
its inputs and of the KV cache it writes to fixed slots, so the re-run gives the tokens the
uninterrupted one would have. Meanwhile ``/health`` answers 503 (afd_common.vllm_glue.role_status).

Lock-step DP attention ranks (several, without ``async_dp``) may be lost a forward apart: one got
its step's last result, another did not and runs the step again; the first waits for it in vLLM's
DP agreement on the next step, while the FFN side's first step of the new world waits for both.
So each rank tells the others in the handshake how many forwards it finished, and a rank ahead
runs an empty step first (``_catch_up``): the FFN side pairs it with the other's re-run.

Without a ride-through (or past its bound) the role ends as before: a running step fails by
itself (its receive raises), so only an idle worker must be ended from outside
(afd_common.vllm_glue.lifecycle).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from afd_common.vllm_glue import lifecycle, role_status
from afd_common import metrics
from afd_common.config import AFDConfig
from afd_common.contract import AttentionConnector
from afd_common.errors import AFDError, AFDHandshakeError, AFDPeerError
from afd_common.metadata import LayerCall, StepKind, StepMetadata
from afd_common.transport.process_groups import CONNECT_PROGRESS_EVERY_S
from afd_common.vllm_glue.model import layer_index

from afd_attention import micro_batches
from afd_attention.micro_batches import MicroBatchPipeline

logger = logging.getLogger("vllm.afd")

_current: AttentionSession | None = None

#: Runs of one forward that the loss of an FFN role may interrupt before the forward fails: a
#: step that takes its FFN role down every time must not cycle through restarts forever.
MAX_RUNS_PER_FORWARD = 3
#: Between attempts to reach a returning FFN role whose world could not form yet.
RETRY_PAUSE_S = 1.0


class StepInterrupted(AFDPeerError):
    """The FFN role was lost during this forward; it runs again from its start once an FFN role
    is back (``AttentionSession.run_forward``)."""


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

    def __init__(self, config: AFDConfig, connector: AttentionConnector, rank: int = 0,
                 new_connector: Callable[[AFDConfig], AttentionConnector] | None = None,
                 thread_setup: Callable[[], None] = lambda: None):
        """``new_connector(config)`` makes the connector of a later world (None: no
        ride-through); ``thread_setup`` runs first in the threads that connect."""
        self.config = config
        self.connector = connector
        self.rank = rank
        self._new_connector = new_connector
        self._thread_setup = thread_setup
        self.reconnect_timeout_s = (config.extra.reconnect_timeout_s
                                    if new_connector is not None else 0.0)
        self.gate_on_attention = config.compute_gate_on_attention
        self.num_stages = config.extra.num_micro_batches
        self.first_layer = connector.shape.moe_layers[0]
        self.last_layer = connector.shape.moe_layers[-1]
        self.metrics = metrics.recorder("attention", config.connector)
        self.step = 0  # in this FFN world: every world's first step is its step 0
        self.forwards_done = 0  # since serving began, in every world: not reset by a loss
        # Ranks that step in lock tell each other their forwards_done in the handshake.
        self._lock_step = (config.num_attention_ranks > 1
                           and not type(connector).supports_async_dp)
        self.worlds = 0  # FFN worlds connected so far
        self._layer_of: dict[str, int] = {}
        self._lock = threading.Lock()
        self._wire_free = threading.Condition(self._lock)
        self._in_step = False  # a forward is past its first MoE layer and not done
        self._on_wire = False  # ... and uses the connector (it does not wait for one)
        self._down_since: float | None = None  # riding through a lost FFN role since then
        self._lost: str | None = None  # why this role cannot go on
        self._planned: tuple[int, ...] | None = None
        self._last_busy = 0
        self._since: list[float | None] = [None] * self.num_stages
        self.closed = False
        self._serving = False  # vLLM's start-up is over: forwards need the FFN role
        self._peers = threading.Event()  # connected, or lost for good (then _lost says why)

    # -- connecting -------------------------------------------------------------------------

    def start_connecting(self) -> None:
        """Connect in a thread: vLLM's start-up goes on meanwhile."""
        self._spawn(self._connect_first, "connect")

    def _spawn(self, target, what: str, *args) -> None:
        threading.Thread(target=target, args=args, name=f"afd-{what}-{self.rank}",
                         daemon=True).start()

    def _connect_first(self) -> None:
        try:
            self._thread_setup()
            self.connector.init()
        except BaseException as e:  # noqa: BLE001 - the role cannot serve: end it, saying why
            if self.closed:  # stopped before the FFN role turned up: nothing failed
                return
            if not isinstance(e, AFDError):
                logger.exception("AFD attention rank %d: unexpected error connecting", self.rank)
            self._end(f"attention rank {self.rank}: could not connect to the FFN role: {e}")
            return
        self.connected(self.connector)

    def connected(self, connector: AttentionConnector | None = None) -> None:
        """``connector`` is connected: steps may use it."""
        if connector is not None:
            connector.watch_peers(lambda reason: self._on_peer_lost(connector, reason))
        with self._lock:
            self.worlds += 1
            if self._down_since is None:  # not lost again before the watch began
                self._peers.set()
        n = self.num_stages
        logger.info("AFD attention rank %d: connected (%d micro-batch%s per step)", self.rank, n,
                    "" if n == 1 else "es")

    def _on_peer_lost(self, connector: AttentionConnector, reason: str) -> None:
        reason = f"attention rank {self.rank}: the FFN role is gone ({reason})"
        where = self.peer_lost(reason, connector)
        if where in ("starting", "in_step", "idle"):
            self._act_on(where, reason)

    def _end(self, reason: str) -> None:
        self._act_on(self.peer_lost(reason, final=True), reason)

    @staticmethod
    def _act_on(where: str, reason: str) -> None:
        """End the role the way ``peer_lost`` said: through vLLM's start-up failure, the failing
        step, or from outside."""
        if where == "starting":  # vLLM's own start-up failure path ends the server
            logger.error("AFD: %s -- vLLM's start-up ends with it", reason)
            return
        lifecycle.mark_failed(reason)
        if where == "idle":
            lifecycle.exit_worker()

    def peer_lost(self, reason: str, connector: AttentionConnector | None = None,
                  final: bool = False) -> str:
        """The FFN role of ``connector`` (default: the current one) is gone. Says who must act:
        "reconnecting" (nobody: the session rides through it), "starting" (vLLM's start-up will
        fail with it: ``startup_done`` raises), "in_step" (the running step raises by itself) or
        "idle" (nothing would raise: the caller must end the worker)."""
        with self._lock:
            if connector is not None and connector is not self.connector:
                return "reconnecting"  # a world already left behind
            if self._lost is None and not final and self._serving and self.reconnect_timeout_s:
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    self._peers.clear()
                    self._spawn(self._ride_through, "reconnect", reason)
                return "reconnecting"
            if self._lost is None:
                self._lost = reason
            self._peers.set()  # a step waiting for the connection raises
            return self._where()

    def _where(self) -> str:
        if not self._serving:
            return "starting"
        return "in_step" if self._in_step else "idle"

    def _ride_through(self, reason: str) -> None:
        """Close the lost world once no step uses it, then connect to whichever FFN role comes
        back, until ``reconnect_timeout_s`` after the loss."""
        budget = self.reconnect_timeout_s
        deadline = self._down_since + budget
        c = self.config
        logger.warning("AFD: %s -- waiting up to %g s (reconnect_timeout_s) for an FFN role "
                       "at %s:%d; requests in flight resume when one is back", reason, budget,
                       c.host, c.port)
        role_status.publish("attention", self.rank, {"rank": self.rank, "reason": reason,
                                            "lost_at": time.time(),
                                            "reconnect_timeout_s": budget})
        try:
            self._thread_setup()
            with self._wire_free:  # a step on the lost world fails by itself, in bounded time
                self._wire_free.wait_for(lambda: not self._on_wire,
                                         max(0.0, deadline - time.monotonic()))
                lost, busy = self.connector, self._on_wire
            if busy:
                raise AFDPeerError("the step on the lost world did not end")
            lost.close()
            last = "no FFN role turned up"
            while not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                connector = self._new_connector(c.with_extra(connect_timeout_s=left))
                if self._lock_step:  # no step runs now: the count is settled
                    connector.steps_done = self.forwards_done
                with self._lock:
                    self.connector = connector  # what close() closes
                    self.step = 0
                try:
                    connector.init()
                    self._catch_up(connector)
                except AFDHandshakeError:
                    raise  # another model or token: waiting longer would not help
                except AFDError as e:
                    last = str(e)
                    connector.close()
                    time.sleep(RETRY_PAUSE_S)
                    continue
                with self._lock:
                    self._down_since = None
                role_status.clear("attention", self.rank)
                logger.info("AFD attention rank %d: an FFN role is back after %.1f s", self.rank,
                            time.monotonic() - deadline + budget)
                self.connected(connector)
                return
            if self.closed:
                return
            raise AFDPeerError(f"{last}")
        except BaseException as e:  # noqa: BLE001 - the ride-through ends here: so does the role
            role_status.clear("attention", self.rank)
            if self.closed:
                return
            if not isinstance(e, AFDError):
                logger.exception("AFD attention rank %d: unexpected error reconnecting",
                                 self.rank)
            self._end(f"{reason}; no FFN role came back within reconnect_timeout_s "
                      f"({budget:g} s): {e}")

    @torch.inference_mode()
    def _catch_up(self, connector: AttentionConnector) -> None:
        """The empty steps the handshake asked for (``catch_up_steps``): each one's every layer
        and stage, without rows, so that this rank's next forward is the other ranks' next step
        too. They run in inference mode, as vLLM's forwards do: the connector adds to tensors
        those forwards made (its metrics' device counters), which outside it would raise."""
        n = connector.catch_up_steps if self._lock_step else 0
        if not n:
            return
        logger.info("AFD attention rank %d: %d empty step%s first: another attention rank runs "
                    "again a forward this rank finished before the loss", self.rank, n,
                    "" if n == 1 else "s")
        shape, device = connector.shape, connector.device
        hidden = torch.empty(0, shape.hidden_size, dtype=shape.dtype, device=device)
        routing = ((torch.empty(0, shape.top_k, dtype=torch.int32, device=device),
                    torch.empty(0, shape.top_k, dtype=torch.float32, device=device))
                   if self.gate_on_attention else (None, None))
        for _ in range(n):
            connector.begin_step(StepMetadata(self.step, StepKind.RUN, (0,) * self.num_stages))
            for layer in shape.moe_layers:
                for stage in range(self.num_stages):
                    connector.recv_ffn_output(connector.send_attn_output(
                        hidden, LayerCall(layer, stage), *routing))
            connector.end_step()
            self.step += 1

    def startup_done(self) -> None:
        """vLLM finished its start-up forwards; from now on every forward is a step. A connection
        that failed meanwhile fails the start-up here, through vLLM's own path for a worker that
        cannot start (ending the worker from outside mid-start-up leaves the server hanging)."""
        with self._lock:
            self._serving = True
            self._raise_if_lost()

    def activate(self) -> None:
        global _current
        _current = self

    # -- steps ------------------------------------------------------------------------------

    def run_forward(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``forward()``, run again from its start if the FFN role is lost during it and another
        comes back (the wait is in the first MoE layer of the new run)."""
        for run in range(1, MAX_RUNS_PER_FORWARD + 1):
            try:
                return forward()
            except StepInterrupted as e:
                if run == MAX_RUNS_PER_FORWARD:
                    reason = (f"attention rank {self.rank}: a forward was interrupted "
                              f"{run} times by the loss of its FFN role: {e}")
                    lifecycle.mark_failed(reason)
                    raise AFDPeerError(reason) from e
                logger.warning("AFD attention rank %d: the forward of step %d was interrupted "
                               "(%s); it runs again once an FFN role is back", self.rank,
                               self.step, e)
        raise AssertionError("unreachable")

    def run_micro_batches(self, pipeline: MicroBatchPipeline, cuts: list[slice],
                          forward: Callable[[slice], torch.Tensor],
                          resume: Callable[[int], None]) -> list[torch.Tensor]:
        """One forward split on ``cuts`` (token slices, one per micro-batch): ``forward(cut)``
        per micro-batch, interleaved by ``pipeline``; the step announces the split."""
        self.plan(tuple(c.stop - c.start for c in cuts) + (0,) * (self.num_stages - len(cuts)))

        def stage(i: int, cut: slice):
            def run():
                self.stage_started(i)
                return forward(cut)
            return run
        return pipeline.run([stage(i, c) for i, c in enumerate(cuts)], resume)

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
        rec = self.metrics
        try:
            if layer == self.first_layer and stage == 0:
                self._begin_step(x.shape[0])
            conn = self.connector  # the same for the whole step: swapped only off the wire
            call = LayerCall(layer, stage)
            sent = time.perf_counter()
            if self._since[stage] is not None:  # None in forwards the runner did not time
                rec.attention_compute(sent - self._since[stage])
            pending = conn.send_attn_output(x.contiguous(), call, topk_ids, topk_weights)
            empty = range(stage + 1, self.num_stages) if stage == self._last_busy else ()
            empties = [conn.send_attn_output(*self._empty_rows(x), LayerCall(layer, s),
                                             *self._empty_routing(topk_ids, topk_weights))
                       for s in empty]
            micro_batches.hand_over()  # the next stage's attention overlaps our experts
            waiting = time.perf_counter()
            out = conn.recv_ffn_output(pending)
            for p in empties:
                conn.recv_ffn_output(p)
            done = self._since[stage] = time.perf_counter()
            rec.wait(done - waiting)
            rec.roundtrip(done - sent)
            rec.moved(sent=metrics.nbytes(x, topk_ids, topk_weights), received=metrics.nbytes(out))
            if layer == self.last_layer and stage == self._last_busy:
                conn.end_step()
                self.step += 1
                self.forwards_done += 1
                self._since = [None] * self.num_stages
                self._off_wire(in_step=False)
        except StepInterrupted:
            raise
        except AFDPeerError as e:
            where = f"step {self.step}, layer {layer}, micro-batch {stage}"
            if self._on_wire and self.peer_lost(
                    f"attention rank {self.rank}: {where}: {e}") == "reconnecting":
                self._since = [None] * self.num_stages
                self._off_wire(in_step=True)
                raise StepInterrupted(f"{where}: {e}") from e
            lifecycle.mark_failed(f"{where}: {e}")
            raise
        except AFDError as e:
            lifecycle.mark_failed(f"step {self.step}, layer {layer}, micro-batch {stage}: {e}")
            raise
        return out

    def _off_wire(self, in_step: bool) -> None:
        with self._wire_free:
            self._in_step, self._on_wire = in_step, False
            self._wire_free.notify_all()

    def _begin_step(self, rows: int) -> None:
        with self._lock:
            self._raise_if_lost()
            self._in_step = True
        while True:
            if not self._peers.is_set():
                self._wait_for_peers()
            with self._lock:
                self._raise_if_lost()
                if self._peers.is_set():  # not lost again meanwhile
                    self._on_wire = True
                    break
        tokens = self._planned or (rows,) + (0,) * (self.num_stages - 1)
        self._planned = None
        self._last_busy = max((s for s, n in enumerate(tokens) if n), default=0)
        self.connector.begin_step(StepMetadata(self.step, StepKind.RUN, tokens))

    def _wait_for_peers(self) -> None:
        c, start = self.config, time.monotonic()
        while not self._peers.wait(CONNECT_PROGRESS_EVERY_S):
            bound = (f"reconnect_timeout_s {self.reconnect_timeout_s:.0f}"
                     if self._down_since is not None
                     else f"connect_timeout_s {c.extra.connect_timeout_s or 'unset'}")
            logger.info("AFD attention rank %d: a step waits for the FFN role at %s:%d (%.0f s; "
                        "%s)", self.rank, c.host, c.port, time.monotonic() - start, bound)

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

    def close(self) -> None:
        global _current
        self.closed = True
        if _current is self:
            _current = None
        with self._lock:
            connector = self.connector
        connector.close()
        role_status.clear("attention", self.rank)
