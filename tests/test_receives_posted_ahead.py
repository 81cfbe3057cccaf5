"""The P2P connector's FFN half posts every receive before its loop asks for it: Gloo holds back
a send whose receive is not posted and moves the data only after another notification round
trip. Over the loopback transport, whose sends complete exactly when the peer posted the
matching receive (as Gloo's), an attention rank's send is taken before the FFN side's loop calls
for it -- each next (layer, stage) when the last result went out, a step's first layer when the
previous step's last result went out (or when its plan arrives, the first time), and two steps'
frames ahead."""

from __future__ import annotations

import pytest
import torch

from afd_common.metadata import LayerCall, ModelShape, StepKind, StepMetadata
from connector_pair import open_pair

CONNECTOR = "LoopbackAFDConnector"
H = 8


@pytest.fixture
def pair():
    shape = ModelShape(hidden_size=H, dtype=torch.float32, num_layers=3, moe_layers=(1, 2),
                       architecture="t")
    a, f = open_pair(CONNECTOR, shape, {"num_micro_batches": 2, "timeout_s": 10})
    yield a, f
    a.close()
    f.close()


def taken(a) -> bool:
    """Whether the FFN side posted the receive of the attention side's last send."""
    (work, _), = [sends[-1] for sends in a._net.data._pending.values()]
    return work.is_completed()


def test_each_send_finds_its_receive_posted(pair):
    a, f = pair
    rows = (3, 2)
    for step in range(2):
        a.begin_step(StepMetadata(step, StepKind.RUN, rows))
        if step:  # posted when the previous step's frame arrived
            assert taken(a)
        plan = f.recv_step()
        for layer in (1, 2):
            pending = []
            for stage in (0, 1):
                x = torch.randn(rows[stage], H)
                pending.append((x, a.send_attn_output(x, LayerCall(layer, stage))))
                assert taken(a), f"layer {layer} stage {stage} of step {step}"
                item = f.recv_layer(stage, layer)
                f.send_ffn_output(item.hidden_states * 2, item)
            for x, p in pending:
                assert torch.equal(a.recv_ffn_output(p), x * 2)
        a.end_step()
        f.end_step()
        assert plan.step == step


def test_the_ffn_loop_must_serve_layers_and_stages_in_order(pair):
    a, f = pair
    a.begin_step(StepMetadata(0, StepKind.RUN, (1, 1)))
    f.recv_step()
    with pytest.raises(RuntimeError, match=r"recv_layer\(layer 1, stage 1\) while layer 1 "
                                           r"stage 0 is next"):
        f.recv_layer(1, 1)


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
def test_receive_buffers_are_reused_two_layers_on(pair, contiguous):
    """The FFN half receives into two buffers per stage in turn (no allocation on the path from
    a result to the next receive): an item's rows stay intact until the result of its stage's
    next layer is sent, and the same (layer, stage) of the next step lands in the same buffer.
    Also when a result takes the general send path (strided), not the one prepared while its
    rows were awaited."""
    a, f = pair

    def result(item):
        out = item.hidden_states + 1
        return out if contiguous else out.t().contiguous().t()

    rows = (3, 2)
    seen = {}
    for step in range(3):
        a.begin_step(StepMetadata(step, StepKind.RUN, rows))
        f.recv_step()
        held = {}
        for layer in (1, 2):
            pending = []
            for stage in (0, 1):
                x = torch.full((rows[stage], H), float(10 * step + layer + stage / 10))
                pending.append((x, a.send_attn_output(x, LayerCall(layer, stage))))
                item = f.recv_layer(stage, layer)
                if layer == 2:  # layer 1's rows of this stage: still there
                    old, want = held[stage]
                    assert torch.equal(old.hidden_states, want), f"step {step} stage {stage}"
                held[stage] = (item, x.clone())
                ptr = item.hidden_states.data_ptr()
                if step == 2:
                    assert ptr == seen[layer, stage], f"layer {layer} stage {stage}: new buffer"
                seen[layer, stage] = ptr
                f.send_ffn_output(result(item), item)
            for x, p in pending:
                assert torch.equal(a.recv_ffn_output(p), x + 1)
        a.end_step()
        f.end_step()
    assert len(set(seen.values())) == 4  # two per stage


def test_a_step_above_max_num_tokens_is_refused_before_anything_is_sent(pair):
    """Both roles size their messages by max_num_tokens: the attention side refuses a longer
    step itself, naming the limit, before anything is sent, and the connector stays usable."""
    a, f = pair
    limit = a.shape.max_num_tokens
    with pytest.raises(ValueError, match=rf"step 0 has {limit + 1} tokens .* max_num_tokens "
                                         rf"{limit}"):
        a.begin_step(StepMetadata(0, StepKind.RUN, (limit, 1)))
    assert not a._net.data._pending and not a._net.control.io._pending
    a.begin_step(StepMetadata(0, StepKind.RUN, (1, 1)))
    f.recv_step()


def test_a_result_of_the_wrong_shape_or_dtype_is_refused_before_it_is_sent(pair):
    """The FFN half checks a result against its item (in one condition on the prepared path,
    one by one otherwise) and sends nothing wrong; the right result then goes as usual."""
    a, f = pair
    a.begin_step(StepMetadata(0, StepKind.RUN, (3, 2)))
    f.recv_step()
    x = torch.randn(3, H)
    pending = a.send_attn_output(x, LayerCall(1, 0))
    item = f.recv_layer(0, 1)
    for bad, needle in ((torch.zeros(2, H), r"shape \(2, 8\)"),
                        (torch.zeros(3, H + 1), r"shape \(3, 9\)"),
                        (torch.zeros(3, H, dtype=torch.float64), "torch.float64")):
        with pytest.raises(ValueError, match=needle):
            f.send_ffn_output(bad, item)
    f.send_ffn_output(item.hidden_states * 3, item)
    assert torch.equal(a.recv_ffn_output(pending), x * 3)
