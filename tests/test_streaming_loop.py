"""The FFN streaming loop: the receive is the clock -- each item's own layer is computed,
zero-row items are acknowledged without computing, and a stop item ends the loop."""

from types import SimpleNamespace

import pytest
import torch

from afd_common import metrics

from afd_common.contract import StreamingFFNConnector
from afd_common.metadata import StepKind, WorkItem, WorkItemMeta
from afd_ffn.streaming_loop import StreamingLoop


class FakeAsyncFFN:
    """A streaming FFN connector (registered as one: it needs none of the base's set-up)."""

    control_plane = None
    local_rank = 0
    device = torch.device("cpu")
    config = SimpleNamespace(connector="FakeAsyncConnector")

    def __init__(self, items):
        self.items = list(items)
        self.sent = []
        self.ends = 0

    def recv_next(self, stage_idx=0, max_num_tokens=None):
        return self.items.pop(0)

    def send_ffn_output(self, output, item):
        self.sent.append((item.layer_idx, output))

    def end_step(self):
        self.ends += 1


StreamingFFNConnector.register(FakeAsyncFFN)


def item(layer, rows, stop=False):
    meta = WorkItemMeta(layer_idx=layer, stage=0, step=0, sources=((0, rows),) if rows else (),
                        is_stop=stop, kind=StepKind.STOP if stop else StepKind.RUN)
    return WorkItem(torch.full((rows, 4), float(layer)), meta)


def test_items_name_their_layer_and_stop_ends_the_loop():
    conn = FakeAsyncFFN([item(5, 2), item(1, 0), item(3, 1), item(-1, 0, stop=True),
                         item(9, 1)])
    computed = []

    def compute(it):
        computed.append(it.layer_idx)
        return it.hidden_states * 10

    served = StreamingLoop(conn, compute).run()
    assert served == 3 and conn.ends == 3
    assert computed == [5, 3]  # the zero-row item is acknowledged without computing
    assert [(layer, out[0, 0].item()) for layer, out in conn.sent] == [(5, 50.0), (3, 30.0)]
    assert len(conn.items) == 1  # nothing read past the stop item
    # What /metrics shows for this loop: one compute per computed item, a wait per receive.
    snap = metrics.snapshot()
    assert snap["labels"] == {"role": "ffn", "connector": "FakeAsyncConnector"}
    assert snap["histograms"]["afd_ffn_compute_seconds"]["count"] == 2
    assert snap["histograms"]["afd_wait_seconds"]["count"] == 4
    assert snap["bytes"] == {"sent": 2 * 4 * 4 + 1 * 4 * 4, "received": 2 * 4 * 4 + 1 * 4 * 4}


def test_refuses_a_scheduled_connector():
    class Scheduled:  # not a StreamingFFNConnector
        local_rank = 0
    with pytest.raises(ValueError, match="scheduled loop"):
        StreamingLoop(Scheduled(), lambda it: it.hidden_states)
