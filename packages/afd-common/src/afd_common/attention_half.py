"""Bookkeeping every attention half needs, whatever moves its rows: the current step, the calls
in flight, and the checks that refuse bad input before anything is sent."""

from __future__ import annotations

from afd_common.contract import AttentionConnector, PendingResult
from afd_common.metadata import LayerCall, StepMetadata


class AttentionHalf(AttentionConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._step: StepMetadata | None = None
        self._inflight: set[LayerCall] = set()  # sent, result not yet received

    def begin_step(self, meta: StepMetadata) -> None:
        if self._inflight:
            raise RuntimeError(f"step {meta.step} begins with results of the previous step "
                               f"still unreceived: {sorted(self._inflight)}")
        self._step = meta
        super().begin_step(meta)

    def _pending(self, call: LayerCall, state) -> PendingResult:
        self._inflight.add(call)
        return PendingResult(call, state)

    def _take(self, pending: PendingResult):
        """The state of a call in flight, once: a handle received twice, or from before a
        close, is refused."""
        if pending.call not in self._inflight:
            raise RuntimeError(f"recv_ffn_output({pending.call}): not in flight (received "
                               f"already?); in flight: {sorted(self._inflight)}")
        self._inflight.discard(pending.call)
        return pending.state

    def _check_send(self, hidden, call, topk_ids, topk_weights) -> int:
        """Rows of ``hidden`` after checking it against the model shape and the step; every
        check runs before anything is sent."""
        shape, step = self.shape, self._step
        if step is None:
            raise RuntimeError("send_attn_output before begin_step")
        shape.check_layer(call.layer_idx)
        if not 0 <= call.stage < step.num_stages:
            raise ValueError(f"stage {call.stage} out of range: step {step.step} has "
                             f"{step.num_stages} stages")
        if call in self._inflight:
            raise RuntimeError(f"{call} sent twice without receiving its result")
        if hidden.dim() != 2 or hidden.shape[1] != shape.hidden_size:
            raise ValueError(f"hidden states of shape {tuple(hidden.shape)}: expected "
                             f"[tokens, {shape.hidden_size}] (hidden_size)")
        if hidden.dtype != shape.dtype:
            raise ValueError(f"hidden states of dtype {hidden.dtype}: this AFD world moves "
                             f"{shape.dtype}")
        rows = hidden.shape[0]
        if rows != step.stage_tokens[call.stage]:
            raise ValueError(f"layer {call.layer_idx} stage {call.stage}: {rows} rows, but step "
                             f"{step.step} announced {step.stage_tokens[call.stage]}")
        gate = self.config.compute_gate_on_attention
        if gate != (topk_ids is not None) or (topk_ids is None) != (topk_weights is None):
            raise ValueError("topk_ids/topk_weights must be given exactly when "
                             f"compute_gate_on_attention is true (it is {gate})")
        if topk_ids is not None:
            want = (rows, shape.top_k)
            if tuple(topk_ids.shape) != want or tuple(topk_weights.shape) != want:
                raise ValueError(f"routing of shapes {tuple(topk_ids.shape)} / "
                                 f"{tuple(topk_weights.shape)}: expected {want} (tokens, top_k)")
        return rows
