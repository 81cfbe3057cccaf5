"""Micro-batch ping-pong without vLLM: the split on request boundaries and the baton."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from afd_attention.micro_batches import (MicroBatchPipeline, current_stage, hand_over,
                                         split_on_requests)


def qsl(*tokens: int) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(tokens)]).astype(np.int32)


@pytest.mark.parametrize("tokens,m,want", [
    ((1,) * 8, 2, [4, 4]),
    ((1,) * 8, 3, [3, 2, 3]),
    ((1,) * 7, 3, [2, 3, 2]),
    ((5, 1, 1, 1), 2, [5, 3]),       # cut between requests, never inside the prefill of 5
    ((1, 1, 1, 9), 2, [3, 9]),
    ((3, 3), 4, [3, 3]),             # fewer requests than m: one request each
    ((7,), 2, [7]),                  # one request: no split
    ((1, 20, 1), 3, [1, 20, 1]),
])
def test_split_on_request_boundaries(tokens, m, want):
    parts = split_on_requests(qsl(*tokens), m)
    assert [t.stop - t.start for _, t in parts] == want
    # Contiguous, covering, at least one request each, token slices matching request slices.
    starts = qsl(*tokens)
    assert parts[0][0].start == 0 and parts[-1][0].stop == len(tokens)
    for (r, t), (r2, _) in zip(parts, parts[1:] + [(slice(len(tokens), None), None)]):
        assert r.stop == r2.start and r.stop > r.start
        assert (t.start, t.stop) == (starts[r.start], starts[r.stop])


def test_stages_take_turns_at_each_hand_over_in_cycle():
    pipeline = MicroBatchPipeline(3)
    log: list[tuple[int, int]] = []

    def forward(layers: int):
        def run():
            stage = current_stage()
            for layer in range(layers):
                log.append((layer, stage))  # "send"
                hand_over()
            return stage
        return run

    resumed: list[int] = []
    assert pipeline.run([forward(3)] * 3, resumed.append) == [0, 1, 2]
    # Layer by layer, stage by stage: the order the FFN role serves them in.
    assert log == [(layer, s) for layer in range(3) for s in range(3)]
    assert resumed[:3] == [0, 1, 2]
    # The threads are reused: a second run, with fewer stages, works the same way.
    log.clear()
    assert pipeline.run([forward(2)] * 2, lambda s: None) == [0, 1]
    assert log == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert threading.active_count() >= 3


def test_a_failing_stage_aborts_the_others_and_its_error_reaches_the_caller():
    pipeline = MicroBatchPipeline(3)
    reached = []

    def ok():
        for _ in range(3):
            hand_over()
        reached.append(current_stage())

    def bad():
        hand_over()
        raise ValueError("stage 1 broke")

    with pytest.raises(ValueError, match="stage 1 broke"):
        pipeline.run([ok, bad, ok], lambda s: None)
    assert reached == []  # nobody ran on past the failure
    assert pipeline.run([lambda: 1, lambda: 2], lambda s: None) == [1, 2]  # still usable
