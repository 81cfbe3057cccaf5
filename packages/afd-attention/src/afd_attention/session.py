"""One attention rank's AFD session: its connector and the step it is in.

A step begins lazily at the first MoE layer of a forward and ends after the last one, so every
forward vLLM runs -- real steps, profile runs, warm-up, the dummy batches of idle DP ranks --
announces itself to the FFN side with the exact token count, and no model-runner hook is needed.

The session also knows whether a step is running when the FFN role is lost: a running step fails
by itself (its receive raises), so only an idle worker must be ended from outside
(afd_common.lifecycle).
"""

from __future__ import annotations

import logging
import threading

import torch

from afd_common.config import AFDConfig
from afd_common.contract import AttentionConnector
from afd_common.errors import AFDError, AFDPeerError
from afd_common.lifecycle import mark_failed
from afd_common.metadata import LayerCall, StepKind, StepMetadata
from afd_common.vllm_model import layer_index

logger = logging.getLogger("vllm.afd")

_current: AttentionSession | None = None


def current() -> AttentionSession:
    if _current is None:
        raise RuntimeError("AFD attention session is not initialised: the model ran before the "
                           "AFD attention worker connected to its FFN role")
    return _current


class AttentionSession:
    def __init__(self, config: AFDConfig, connector: AttentionConnector):
        self.config = config
        self.connector = connector
        self.gate_on_attention = config.compute_gate_on_attention
        self.first_layer = connector.shape.moe_layers[0]
        self.last_layer = connector.shape.moe_layers[-1]
        self.step = 0
        self._layer_of: dict[str, int] = {}
        self._lock = threading.Lock()
        self._in_step = False
        self._lost: str | None = None

    def activate(self) -> None:
        global _current
        _current = self

    def remote_experts(self, layer_name: str, x: torch.Tensor, topk_weights, topk_ids):
        layer = self._layer_of.get(layer_name)
        if layer is None:
            layer = self._layer_of[layer_name] = layer_index(layer_name)
        conn = self.connector
        try:
            if layer == self.first_layer:
                with self._lock:
                    if self._lost is not None:
                        raise AFDPeerError(self._lost)
                    self._in_step = True
                conn.begin_step(StepMetadata(self.step, StepKind.RUN, (x.shape[0],)))
            call = LayerCall(layer, 0)
            conn.send_attn_output(x.contiguous(), call, topk_ids, topk_weights)
            out = conn.recv_ffn_output(call)
            if layer == self.last_layer:
                conn.end_step()
                self.step += 1
                with self._lock:
                    self._in_step = False
        except AFDError as e:
            mark_failed(f"step {self.step}, layer {layer}: {e}")
            raise
        return out

    def peer_lost(self, reason: str) -> bool:
        """Record that the FFN role is gone; no step starts after this. True when no step is
        running, so nothing will raise by itself and the caller must end the worker."""
        with self._lock:
            self._lost = reason
            return not self._in_step

    def close(self) -> None:
        global _current
        if _current is self:
            _current = None
        self.connector.close()
