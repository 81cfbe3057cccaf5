"""The FFN serving loop of a ``StreamingFFNConnector``: the receive is the clock.

Each work item names its own layer (read off the wire), so the loop needs no step schedule: it
runs whatever arrives -- any attention DP group, any layer -- and returns it. Zero-row items are
acknowledged without computing; stop items from every attention DP group end the loop.
"""

from __future__ import annotations

import logging

from afd_common.contract import StreamingFFNConnector

from afd_ffn.serving_loop import ComputeFn, ServingLoop

logger = logging.getLogger("vllm.afd")


class StreamingLoop(ServingLoop):
    """``steps_done`` counts work items: the unit ``/health`` reports for this loop."""

    def __init__(self, connector: StreamingFFNConnector, compute: ComputeFn, stage: int = 0):
        if not isinstance(connector, StreamingFFNConnector):
            raise ValueError(f"{type(connector).__name__} is scheduled by a control plane: use "
                             "the scheduled loop")
        super().__init__(connector, compute)
        self.stage = stage

    def run_step(self) -> bool:
        """Serve one work item. False once every attention DP group sent its stop item."""
        conn = self.connector
        item = self._receive(conn.recv_next, self.stage)
        if item.meta.is_stop:
            logger.info("AFD FFN rank %d: every attention rank stopped after %d work items",
                        conn.local_rank, self.steps_done)
            return False
        if item.num_tokens:  # a work item without rows (an idle DP group's) needs no answer
            self._answer(item)
        return self._served()
