"""The FFN serving loop of a ``ScheduledFFNConnector``: the control plane's step message drives it.

Per step: wait for the step metadata, then for each MoE layer and each micro-batch stage, receive
the rows, run the experts, send the result. Stages are served in order, so the attention side can
overlap stage s+1's attention with stage s's experts.
"""

from __future__ import annotations

import logging

from afd_common.contract import ScheduledFFNConnector
from afd_common.metadata import StepKind

from afd_ffn.serving_loop import ComputeFn, ServingLoop

logger = logging.getLogger("vllm.afd")


class ScheduledLoop(ServingLoop):
    def __init__(self, connector: ScheduledFFNConnector, compute: ComputeFn):
        if not isinstance(connector, ScheduledFFNConnector):
            raise ValueError(f"{type(connector).__name__} streams its work items: use the "
                             "streaming loop")
        super().__init__(connector, compute)

    def run_step(self) -> bool:
        """Serve one step. False once the attention side said STOP."""
        conn = self.connector
        plan = conn.recv_step()
        if plan.kind == StepKind.STOP:
            logger.info("AFD FFN rank %d: attention side stopped after %d steps",
                        conn.local_rank, self.steps_done)
            return False
        for layer in conn.shape.moe_layers:  # the order the connector posts receives in
            for stage in range(plan.num_stages):
                self._answer(self._receive(conn.recv_layer, stage, layer))
        return self._served()
