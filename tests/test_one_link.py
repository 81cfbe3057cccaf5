"""The P2P connector's compiled one-link path (afd_common.transport.one_link) over Gloo, both
halves in this process: it serves an A:F 1:1 link, gives the Python path's results and errors,
hands over to the Python path for what it does not take, and stands aside when told to."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from afd_common.contract import StepPlan
from afd_common.errors import AFDPeerError, AFDTimeoutError
from afd_common.metadata import LayerCall, ModelShape, StepKind, StepMetadata
from afd_common.transport import one_link
from connector_pair import open_pair
from hypothesis import given, settings
from test_malicious_peer import frames

H = 8
LAYERS = (1, 2, 3)  # three: a stage's ring reuses layer 1's buffer for layer 3


def gloo_pair(timeout_s: float = 10.0, dtype=torch.float32):
    shape = ModelShape(hidden_size=H, dtype=dtype, num_layers=4, moe_layers=LAYERS,
                       architecture="t")
    return open_pair("P2pAFDConnector", shape,
                     {"num_micro_batches": 2, "timeout_s": timeout_s, "backend": "gloo"})


@pytest.fixture
def pair():
    a, f = gloo_pair()
    yield a, f
    a.close()
    f.close()


@pytest.fixture(params=["compiled", "python"])
def either(request, monkeypatch):
    """A pair on either path: what both must do alike."""
    if request.param == "python":
        monkeypatch.setenv(one_link.ENV, "0")
    else:
        monkeypatch.delenv(one_link.ENV, raising=False)
    a, f = gloo_pair()
    assert (a._compiled is not None) == (request.param == "compiled")
    yield a, f
    a.close()
    f.close()


def test_the_compiled_module_is_built():
    """CI builds it (a compiler is there): a missing module would silently test the Python path
    twice."""
    assert one_link.available()


def test_a_module_built_for_another_torch_is_not_used(monkeypatch):
    said = []
    monkeypatch.setattr(one_link.logger, "warning", lambda msg, *args: said.append(msg % args))
    monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
    assert one_link._load() is None
    built = one_link._module.torch_version
    assert said and f"built against torch {built}, this is torch 2.99.0" in said[0], said
    assert "reinstall afd-common" in said[0]


def test_a_one_to_one_link_is_compiled_on_both_sides(pair):
    a, f = pair
    assert a._compiled is not None and f._compiled is not None


def test_the_links_answer_the_primitives_until_the_connector_closes():
    """Each half's per-layer primitives are its link's methods while it is open (no Python frame
    on a layer's path), the class's again once it closed."""
    a, f = gloo_pair()
    for half in (a, f):
        for name in one_link.PRIMITIVES[half.role]:
            assert getattr(half, name).__self__ is half._compiled, name
    a.close()
    f.close()
    for half in (a, f):
        for name in one_link.PRIMITIVES[half.role]:
            assert name not in vars(half) and getattr(half, name).__self__ is half, name


def test_a_links_method_kept_past_close_or_never_bound_refuses_calls():
    """The link lets go of its connector at close: a method of it kept from before says so, as
    one of a link no connector bound does (neither crashes)."""
    a, f = gloo_pair()
    send, recv = a.send_attn_output, f.recv_layer
    unbound = type(a._compiled)(a._net.data.group, 1, torch.float32, H, list(LAYERS), 4)
    with pytest.raises(RuntimeError, match="connector this compiled link served is closed"):
        unbound.send_attn_output(torch.ones(1, H), LayerCall(1))
    a.close()
    f.close()
    for call in (lambda: send(torch.ones(1, H), LayerCall(1)), lambda: recv(0, 1)):
        with pytest.raises(RuntimeError, match="connector this compiled link served is closed"):
            call()


@pytest.mark.parametrize("compiled", ["attention", "ffn"])
def test_the_links_write_and_read_plans_as_the_codec_does(compiled, monkeypatch):
    """Each half's link handles a step's plan itself (a copy of the codec's STEP layout): the
    attention link writes the codec's bytes, zeros after them, and the FFN link reads the
    codec's frames as the codec does, for plans of one to 64 stages, large steps and counts,
    and stages without rows. The other half runs its Python path, the codec's."""
    from afd_common.metadata import MAX_STAGES
    from afd_common.transport import codec, control_plane

    python = "ffn" if compiled == "attention" else "attention"
    monkeypatch.setattr(one_link, f"{python}_link", lambda *args: None)
    a, f = gloo_pair()
    frames, sent = [], []  # frames the codec decoded; plans the control plane sent
    decode = control_plane.decode_step
    monkeypatch.setattr(control_plane, "decode_step",
                        lambda data: frames.append(bytes(data)) or decode(data))
    send = a._net.control.send_step
    monkeypatch.setattr(a._net.control, "send_step", lambda meta: sent.append(meta) or send(meta))
    plans = [StepMetadata(0, StepKind.RUN, (1,)),
             StepMetadata(2**40 + 3, StepKind.RUN, (0, 5, 3)),
             StepMetadata(7, StepKind.RUN, tuple(i % 3 for i in range(MAX_STAGES))),
             StepMetadata(8, StepKind.RUN, (a.shape.max_num_tokens,))]
    received = []
    recv_step = f.recv_step
    monkeypatch.setattr(f, "recv_step", lambda: received.append(recv_step()) or received[-1])
    t, errors, _ = serve(f, len(plans))
    for meta in plans:
        a.begin_step(meta)
        for layer in LAYERS:
            pending = [a.send_attn_output(torch.ones(n, H), LayerCall(layer, s))
                       for s, n in enumerate(meta.stage_tokens)]
            for p in pending:
                a.recv_ffn_output(p)
        a.end_step()
    t.join(30)
    assert not errors
    assert [plan.per_source for plan in received] == [{0: meta} for meta in plans]
    if compiled == "attention":
        assert not sent
        assert frames == [codec.encode_step(m).ljust(codec.STEP_FRAME_BYTES, b"\0")
                          for m in plans]
    else:
        assert sent == plans and not frames
        # The link makes StepPlan and StepMetadata without their __init__ (csrc/one_link.cpp
        # new_dataclass): the same instances, as long as __init__ only sets the fields.
        for plan, meta in zip(received, plans):
            assert type(plan) is StepPlan and vars(plan) == vars(StepPlan(meta.step, {0: meta}))
            made = plan.per_source[0]
            assert type(made) is StepMetadata and vars(made) == vars(meta)
        assert not hasattr(StepPlan, "__post_init__")
        assert not hasattr(StepMetadata, "__post_init__")
    a.close()
    f.close()


@settings(max_examples=1000, deadline=None)
@given(frame=frames())
def test_the_ffn_links_decoder_reads_what_the_codec_reads_and_refuses_the_rest(frame):
    """Whatever a peer sends: the compiled decoder gives the codec's plan or refuses it as the
    codec does (the step kind's value is the link's to check, against StepKind)."""
    from afd_common.errors import AFDProtocolError
    from afd_common.transport import codec

    padded = frame.ljust(codec.STEP_FRAME_BYTES, b"\0")
    read = one_link._module.read_step_frame(frame, *codec.STEP_FRAME)
    try:
        meta = codec.decode_step(padded)
    except AFDProtocolError:
        meta = None
    if read is None:
        assert meta is None, meta
    elif read[1] in {k.value for k in StepKind}:
        assert meta is not None and (meta.step, meta.kind.value, meta.stage_tokens) == (
            read[0], read[1], tuple(read[2]))


def test_a_plan_the_ffn_link_does_not_begin_is_the_connector_s(pair, monkeypatch):
    """A malformed frame or a plan above max_num_tokens is refused by name (the codec's and the
    connector's errors), a STOP ends the step loop, each through the connector's Python."""
    from afd_common.errors import AFDPeerError, AFDProtocolError
    from afd_common.transport import codec
    from afd_common.transport.control_plane import CONTROL_TAG

    a, f = pair
    control = a._net.control
    limit = f.shape.max_num_tokens

    def send_raw(frame: bytes):
        buf = torch.frombuffer(bytearray(frame.ljust(codec.STEP_FRAME_BYTES, b"\0")),
                               dtype=torch.uint8)
        control.io.isend(buf, 1, CONTROL_TAG)

    send_raw(b"XX" + codec.encode_step(StepMetadata(0, StepKind.RUN, (1,)))[2:])
    with pytest.raises(AFDPeerError, match="malformed step metadata from global rank 0: bad "
                                           "magic"):
        f.recv_step()
    send_raw(codec.encode_step(StepMetadata(1, StepKind.RUN, (limit, 1))))
    with pytest.raises(AFDProtocolError, match=rf"announced {limit + 1} tokens for step 1"):
        f.recv_step()
    send_raw(codec.encode_step(StepMetadata(2, StepKind.STOP, (0,))))
    assert f.recv_step().kind == StepKind.STOP


def test_a_plan_the_link_does_not_take_is_the_class_s_to_send_or_refuse(pair):
    """Above max_num_tokens, or with a call in flight, the class's begin_step names what is
    wrong and sends nothing; a plan of another type it sends itself."""
    import dataclasses

    a, f = pair
    limit = a.shape.max_num_tokens
    with pytest.raises(ValueError, match=rf"{limit + 1} tokens .* max_num_tokens {limit}"):
        a.begin_step(StepMetadata(0, StepKind.RUN, (limit, 1)))

    @dataclasses.dataclass(frozen=True)
    class Plan(StepMetadata):
        pass

    t, errors, _ = serve(f, 2)
    for step, meta in enumerate([Plan(0, StepKind.RUN, (1,)), StepMetadata(1, StepKind.RUN, (1,))]):
        a.begin_step(meta)
        pending = a.send_attn_output(torch.ones(1, H), LayerCall(LAYERS[0]))
        if step == 1:
            with pytest.raises(RuntimeError, match="still unreceived"):
                a.begin_step(StepMetadata(2, StepKind.RUN, (1,)))
        a.recv_ffn_output(pending)
        for layer in LAYERS[1:]:
            a.recv_ffn_output(a.send_attn_output(torch.ones(1, H), LayerCall(layer)))
        a.end_step()
    t.join(30)
    assert not errors and a._step.step == 1


def test_the_next_plans_receive_is_posted_as_the_ffn_goes_idle(pair):
    """Two plans' receives are posted as the FFN side asks for a plan; the one a step's plan
    took is posted again at the next ``recv_step``, not on the way from the plan to the first
    rows nor between the step's layers, and the next plan's stays posted the whole step."""
    a, f = pair
    posted = f._compiled.num_plans_posted  # the link receives the plans (not the control plane)
    for step in range(2):
        a.begin_step(StepMetadata(step, StepKind.RUN, (1, 1)))
        pending = [a.send_attn_output(torch.ones(1, H), LayerCall(layer, s))
                   for layer in LAYERS for s in (0, 1)]
        assert f.recv_step().step == step
        assert posted() == 1 and not f._net.control._posted
        for layer in LAYERS:
            for stage in (0, 1):
                item = f.recv_layer(stage, layer)
                f.send_ffn_output(item.hidden_states, item)
                assert posted() == 1 and not f._net.control._posted
        for p in pending:
            assert torch.equal(a.recv_ffn_output(p), torch.ones(1, H))
        a.end_step()
        f.end_step()


def test_a_runners_row_bound_is_checked_on_the_compiled_path(pair):
    a, f = pair
    a.begin_step(StepMetadata(0, StepKind.RUN, (2,)))
    pending = a.send_attn_output(torch.ones(2, H), LayerCall(1))
    f.recv_step()
    with pytest.raises(ValueError, match="step 0 stage 0 brings 2 rows, more than "
                                         "max_num_tokens 1"):
        f.recv_layer(0, 1, max_num_tokens=1)
    item = f.recv_layer(0, 1, max_num_tokens=2)
    assert f._compiled_step and item.meta.sources == ((0, 2),) and item.meta.step == 0
    f.send_ffn_output(item.hidden_states, item)
    assert torch.equal(a.recv_ffn_output(pending), torch.ones(2, H))


def test_a_primitive_called_by_keyword_is_answered_by_the_class(pair, monkeypatch):
    """The links' methods take their arguments by position, with no argument parsing on a
    layer's path; a call by keyword, or with a missing argument, goes to the connector's own
    method, which answers it (through the link's lower-level calls, counted here), or names what
    is wrong, as it would have."""
    a, f = pair
    by_class = []
    for link, name in ((a._compiled, "send"), (f._compiled, "recv")):
        method = getattr(type(link), name)
        monkeypatch.setattr(type(link), name,
                            lambda self, *args, _m=method, _n=name: by_class.append(_n)
                            or _m(self, *args))
    a.begin_step(meta=StepMetadata(0, StepKind.RUN, (1,)))
    pending = a.send_attn_output(hidden_states=torch.ones(1, H), call=LayerCall(1))
    f.recv_step()
    item = f.recv_layer(stage_idx=0, layer_idx=1)
    f.send_ffn_output(output=item.hidden_states * 2, item=item)
    assert torch.equal(a.recv_ffn_output(pending=pending), torch.full((1, H), 2.0))
    assert by_class == ["send", "recv"]
    pending = a.send_attn_output(torch.ones(1, H), LayerCall(2))  # by position: the link's
    item = f.recv_layer(0, 2)
    f.send_ffn_output(item.hidden_states, item)
    assert torch.equal(a.recv_ffn_output(pending), torch.ones(1, H))
    assert by_class == ["send", "recv"]
    with pytest.raises(TypeError, match="pending"):
        a.recv_ffn_output()
    with pytest.raises(TypeError, match="item"):
        f.send_ffn_output(torch.ones(1, H))


def test_env_keeps_the_python_path(monkeypatch):
    monkeypatch.setenv(one_link.ENV, "0")
    a, f = gloo_pair()
    try:
        assert a._compiled is None and f._compiled is None
    finally:
        a.close()
        f.close()


def serve(f, steps: int, result=lambda item: item.hidden_states * 2, answer_empty=True):
    """The FFN loop in a thread: ``result`` of each item sent back (an empty item's only if
    ``answer_empty``); exceptions kept. Each item's rows must stay as received until the result
    of its stage's next layer is sent (``recv_layer``'s promise): checked when the next layer's
    rows are in hand."""
    errors, compiled = [], []

    def run():
        try:
            for _ in range(steps):
                plan = f.recv_step()
                compiled.append(f._compiled_step)
                held = {}
                for layer in LAYERS:
                    for stage in range(plan.num_stages):
                        item = f.recv_layer(stage, layer)
                        if stage in held:
                            old, rows = held[stage]
                            assert torch.equal(old.hidden_states, rows), (layer, stage)
                        held[stage] = (item, item.hidden_states.clone())
                        if item.num_tokens or answer_empty:
                            f.send_ffn_output(result(item), item)
                f.end_step()
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, errors, compiled


def run_steps(a, steps, strided_layer=None):
    """The attention side of ``steps`` (rows per stage), each result checked against the FFN
    loop's (``serve``, the default result); ``strided_layer``'s rows are sent strided, which the
    compiled path hands to the Python path."""
    for step, stage_rows in enumerate(steps):
        a.begin_step(StepMetadata(step, StepKind.RUN, stage_rows))
        for layer in LAYERS:
            sent = []
            for stage, n in enumerate(stage_rows):
                x = torch.randn(n, H)
                if layer == strided_layer:
                    x = x.t().contiguous().t()
                pending = a.send_attn_output(x, LayerCall(layer, stage))
                assert (a._compiled is not None and pending.state is a._compiled) == (
                    a._compiled is not None and x.is_contiguous() and n > 0)
                sent.append((x, pending))
            for x, pending in sent:
                assert torch.equal(a.recv_ffn_output(pending), x * 2)
        a.end_step()


@pytest.mark.parametrize("rows", [(3, 2), (0, 2), (4, 0), (1, 1), (0, 0)])
def test_results_match_also_with_stages_without_rows(either, rows):
    """Strided tensors on either side too: the attention side hands them to the Python path
    (mixing both on one link in a step), the FFN side sends a contiguous copy. The compiled FFN
    half serves every step, its first stage without rows or with max_num_tokens (the receive
    posted ahead, kept over a step whose first stage has none, fits any plan)."""
    a, f = either
    steps = [rows, (2, 3), rows, (a.shape.max_num_tokens, 0), rows, (1, 1)]
    t, errors, compiled = serve(f, len(steps), result=lambda item: (item.hidden_states * 2).t()
                                .contiguous().t())
    run_steps(a, steps, strided_layer=LAYERS[0])  # the first: into the receive posted ahead
    t.join(30)
    assert not errors, errors
    assert compiled == [f._compiled is not None] * len(steps)


def test_the_first_receive_lands_where_the_item_is_read_also_as_its_buffer_grows(either):
    """The step's first receive, posted ahead with the last answer, grows a buffer of the first
    stage's ring to max_num_tokens: its item must read that buffer, not the one it replaced
    (the ring keeps each buffer's views; a fresh pair's second step is the first to use it)."""
    a, f = either
    steps = [(1, 1), (1, 1), (2, 1), (1, 1)]
    t, errors, compiled = serve(f, len(steps))
    run_steps(a, steps)
    t.join(30)
    assert not errors, errors


CLOSE_RACE = """
import random, sys, threading, torch
sys.setswitchinterval(1e-6)
from test_one_link import gloo_pair, H, LAYERS
from afd_common.metadata import LayerCall, StepKind, StepMetadata

def loop(body):
    try:
        while True:
            body()
    except Exception:
        pass  # the close's error, by name: what this checks is that the process lives

for attempt in range(12):
    a, f = gloo_pair(timeout_s=3.0)
    step = iter(range(10**9))
    def ffn():
        plan = f.recv_step()
        for layer in LAYERS:
            for s in range(plan.num_stages):
                item = f.recv_layer(s, layer)
                f.send_ffn_output(item.hidden_states, item)
        f.end_step()
    def attention():
        a.begin_step(StepMetadata(next(step), StepKind.RUN, (1, 1)))
        for layer in LAYERS:
            for p in [a.send_attn_output(torch.ones(1, H), LayerCall(layer, s)) for s in (0, 1)]:
                a.recv_ffn_output(p)
        a.end_step()
    threads = [threading.Thread(target=loop, args=(body,)) for body in (ffn, attention)]
    for t in threads:
        t.start()
    threading.Event().wait(random.uniform(0.05, 0.25))
    (f if attempt % 2 else a).close()
    (a if attempt % 2 else f).close()
    for t in threads:
        t.join(10)
print("lived")
"""


def test_a_close_between_a_links_two_posts_ends_the_loop_not_the_process(tmp_path):
    """Each post lets the GIL go, and a close from another thread may come between a layer's
    two (a send and its answer's receive; an answer and the next receive): the next finds the
    link released and fails by name instead of posting on a group that is gone. Steps serving
    on both sides in threads, each side closed at a random moment, twelve times."""
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", CLOSE_RACE], cwd=here, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "lived" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_a_loop_may_leave_empty_items_unanswered(either):
    """As the Python path lets it (afd-selftest's loop does): nothing travels for them."""
    a, f = either
    steps = [(0, 2), (2, 0), (0, 0), (1, 1)]
    t, errors, compiled = serve(f, len(steps), answer_empty=False)
    run_steps(a, steps)
    t.join(30)
    assert not errors, errors
    assert compiled == [f._compiled is not None] * len(steps)


def test_the_next_steps_first_rows_land_before_the_ffn_side_asks(pair):
    """The compiled FFN half posts the next step's first receive with a step's last result: the
    peer's next rows are taken while the FFN side is still busy with anything else (Gloo holds a
    send back until its receive is posted), so they do not wait for the plan to be decoded."""
    a, f = pair
    t, errors, _ = serve(f, 1)
    x = torch.randn(3, H)
    a.begin_step(StepMetadata(0, StepKind.RUN, (3, 0)))
    for layer in LAYERS:
        assert torch.equal(a.recv_ffn_output(a.send_attn_output(x, LayerCall(layer, 0))), x * 2)
    a.end_step()
    t.join(30)
    assert not errors, errors
    a.begin_step(StepMetadata(1, StepKind.RUN, (2, 0)))
    pending = a.send_attn_output(x[:2], LayerCall(LAYERS[0], 0))
    a._compiled.flush(5.0)  # the rows taken: nothing on the FFN side asked for the step yet
    t, errors, _ = serve(f, 1)
    assert torch.equal(a.recv_ffn_output(pending), x[:2] * 2)
    for layer in LAYERS[1:]:
        assert torch.equal(a.recv_ffn_output(a.send_attn_output(x[:2], LayerCall(layer, 0))),
                           x[:2] * 2)
    a.end_step()
    t.join(30)
    assert not errors, errors


def test_rows_reach_the_metrics(either):
    a, f = either
    before = a._rec.routed_rows.get(0, 0)
    t, errors, _ = serve(f, 1)
    a.begin_step(StepMetadata(0, StepKind.RUN, (3, 2)))
    for layer in LAYERS:
        for stage, n in enumerate((3, 2)):
            a.recv_ffn_output(a.send_attn_output(torch.ones(n, H), LayerCall(layer, stage)))
    a.end_step()
    t.join(30)
    assert not errors
    assert a._rec.routed_rows[0] == before + 5 * len(LAYERS)


def test_attention_misuse_is_named(either):
    a, f = either
    t, errors, _ = serve(f, 1)
    a.begin_step(StepMetadata(0, StepKind.RUN, (1, 1)))
    x = torch.ones(1, H)
    with pytest.raises(ValueError, match="announced 1"):
        a.send_attn_output(torch.ones(2, H), LayerCall(1, 0))
    pending = a.send_attn_output(x, LayerCall(1, 0))
    with pytest.raises(RuntimeError, match="sent twice"):
        a.send_attn_output(x, LayerCall(1, 0))
    with pytest.raises(RuntimeError, match=r"still unreceived: \[LayerCall\(layer_idx=1, "
                                           r"stage=0\)\]"):
        a.begin_step(StepMetadata(1, StepKind.RUN, (1, 1)))
    assert torch.equal(a.recv_ffn_output(pending), x * 2)
    with pytest.raises(RuntimeError, match="not in flight"):
        a.recv_ffn_output(pending)
    for call in [LayerCall(1, 1)] + [LayerCall(layer, s) for layer in LAYERS[1:] for s in (0, 1)]:
        a.recv_ffn_output(a.send_attn_output(x, call))
    a.end_step()
    t.join(30)
    assert not errors


def test_a_call_in_flight_on_either_path_is_not_sent_again(either):
    """A strided block takes the Python path; the same call again, contiguous, must not slip
    into the compiled one (nor the other way round)."""
    a, f = either
    t, errors, _ = serve(f, 1)
    a.begin_step(StepMetadata(0, StepKind.RUN, (2, 2)))
    strided, x = torch.ones(H, 2).t(), torch.ones(2, H)
    for first, again, call in ((strided, x, LayerCall(1, 0)), (x, strided, LayerCall(1, 1))):
        pending = a.send_attn_output(first, call)
        with pytest.raises(RuntimeError, match="sent twice"):
            a.send_attn_output(again, call)
        assert torch.equal(a.recv_ffn_output(pending), x * 2)
    for layer in LAYERS[1:]:
        for stage in (0, 1):
            a.recv_ffn_output(a.send_attn_output(x, LayerCall(layer, stage)))
    a.end_step()
    t.join(30)
    assert not errors


def test_ffn_misuse_is_named(pair):
    a, f = pair
    a.begin_step(StepMetadata(0, StepKind.RUN, (1, 1)))
    pending = a.send_attn_output(torch.ones(1, H), LayerCall(1, 0))
    f.recv_step()
    with pytest.raises(RuntimeError, match=r"recv_layer\(layer 1, stage 1\) while layer 1 "
                                           r"stage 0 is next"):
        f.recv_layer(1, 1)
    item = f.recv_layer(0, 1)
    with pytest.raises(ValueError, match="FFN output of shape"):
        f.send_ffn_output(torch.ones(2, H), item)
    with pytest.raises(RuntimeError, match=r"recv_layer\(layer 2, stage 0\) while layer 1 "
                                           r"stage 0 is being served"):
        f.recv_layer(0, 2)
    f.send_ffn_output(item.hidden_states, item)
    with pytest.raises(RuntimeError, match="send_ffn_output for layer 1 stage 0 of step 0 while "
                                           "layer 1 stage 1 is next"):
        f.send_ffn_output(item.hidden_states, item)
    with pytest.raises(RuntimeError, match="layer 1 stage 1 of step 0 is unserved"):
        f.recv_step()
    assert torch.equal(a.recv_ffn_output(pending), torch.ones(1, H))


def test_ffn_calls_after_the_step_is_served_are_named(pair):
    a, f = pair
    a.begin_step(StepMetadata(0, StepKind.RUN, (2,)))
    f.recv_step()
    for layer in LAYERS:
        pending = a.send_attn_output(torch.ones(2, H), LayerCall(layer))
        item = f.recv_layer(0, layer)
        f.send_ffn_output(item.hidden_states, item)
        a.recv_ffn_output(pending)
    with pytest.raises(RuntimeError, match=r"recv_layer\(layer 1, stage 0\) while step 0 is "
                                           "served"):
        f.recv_layer(0, 1)
    with pytest.raises(RuntimeError, match="send_ffn_output for layer 3 stage 0 of step 0 while "
                                           "step 0 is served"):
        f.send_ffn_output(item.hidden_states, item)


def test_the_ffn_half_settles_its_sends_before_letting_go_of_them(pair):
    """Closing waits (bounded) until the peer took the last results, then drops the link."""
    a, f = pair
    calls = []

    class Recording:
        def flush(self, timeout_s):
            calls.append("flush")

        def drop(self):
            calls.append("drop")

    real, f._compiled = f._compiled, Recording()
    f.close()
    real.drop()
    assert calls == ["flush", "drop"]


@pytest.mark.parametrize("kind,error,raised,words", [
    ("send", "Connection reset", AFDPeerError, "send to FFN rank 0 failed: Connection reset"),
    ("post", "Connection closed", AFDPeerError,
     "lost FFN rank 0 before receiving the FFN result of layer 1 stage 0: Connection closed"),
    ("wait", "[pair.cc:1] Timed out waiting 1000ms\nmore", AFDTimeoutError,
     "no the FFN result of layer 1 stage 0 from FFN rank 0 within 1.0 s"),
    ("wait", "Connection closed by peer\nsecond line", AFDPeerError,
     "lost FFN rank 0 while waiting for the FFN result of layer 1 stage 0: Connection closed by "
     "peer"),
    ("settle", "line one\noperation timed out", AFDTimeoutError,
     "FFN rank 0 did not take a message we sent within 1.0 s: line one"),
    ("settle", "Connection closed", AFDPeerError,
     "FFN rank 0 did not take a message we sent: Connection closed"),
])
def test_compiled_failures_are_worded_as_the_python_paths(kind, error, raised, words):
    """The compiled link hands the backend's whole message over; PeerIO words it (its first line
    shown, a timeout found anywhere in it) as it words its own."""
    from types import SimpleNamespace

    from afd_common.transport.peer_io import PeerIO

    io = PeerIO(SimpleNamespace(name=lambda: "gloo"), lambda rank: f"FFN rank {rank}")
    e = one_link.failure(SimpleNamespace(data=io), one_link.LinkError(kind, error), 0,
                         ("the FFN result of layer {} stage {}", 1, 0), 1.0)
    assert type(e) is raised and str(e).startswith(words), str(e)
    assert "second line" not in str(e) and "more" not in str(e)


def test_a_failed_post_on_the_ffn_side_names_the_item_it_was_for(pair):
    """The compiled link posts the next item's receive (or the next step's first) with a send,
    or past an empty item: a failed post names that item, not the one served."""
    a, f = pair
    a.begin_step(StepMetadata(0, StepKind.RUN, (1, 1)))
    f.recv_step()
    post, wait = (one_link.LinkError(kind, "Connection closed") for kind in ("post", "wait"))
    for (layer, stage), named in [((1, 0), (1, 1)), ((1, 1), (2, 0)), ((3, 1), (1, 0))]:
        assert f"hidden states of layer {named[0]} stage {named[1]}:" in str(
            f._failure_from(post, layer, stage))
    assert "hidden states of layer 3 stage 1:" in str(f._failure_from(wait, 3, 1))


def test_a_silent_peer_times_out_naming_the_wait():
    a, f = gloo_pair(timeout_s=1.0)
    try:
        a.begin_step(StepMetadata(0, StepKind.RUN, (1, 1)))
        pending = a.send_attn_output(torch.ones(1, H), LayerCall(1, 0))
        start = time.monotonic()
        with pytest.raises(AFDTimeoutError, match=r"no the FFN result of layer 1 stage 0 from FFN "
                                                  r"rank 0 \(global 1\) within 1.0 s") as raised:
            try:
                raise KeyError("being handled when the wait fails")
            except KeyError:
                a.recv_ffn_output(pending)
        assert time.monotonic() - start < 5
        # Raised as the Python path raises it (from None): no cause, the context suppressed.
        assert raised.value.__cause__ is None and raised.value.__suppress_context__
    finally:
        a.close()
        f.close()


def test_a_lost_peer_is_named_on_either_side():
    a, f = gloo_pair()
    try:
        a.begin_step(StepMetadata(0, StepKind.RUN, (1, 1)))
        f.recv_step()
        pending = a.send_attn_output(torch.ones(1, H), LayerCall(1, 0))
        threading.Timer(0.3, f.close).start()
        with pytest.raises(AFDPeerError, match=r"lost FFN rank 0 \(global 1\) while waiting for "
                                               r"the FFN result of layer 1 stage 0: .*closed"):
            a.recv_ffn_output(pending)
    finally:
        a.close()
        f.close()
    a, f = gloo_pair()
    try:
        a.begin_step(StepMetadata(0, StepKind.RUN, (1, 1)))
        f.recv_step()
        threading.Timer(0.3, a.close).start()
        with pytest.raises(AFDPeerError, match=r"lost attention rank 0 \(global 0\) while "
                                               r"waiting for hidden states of layer 1 stage 0"):
            f.recv_layer(0, 1)
    finally:
        a.close()
        f.close()


def test_an_ffn_link_waiting_for_a_plan_past_its_connector_s_close_ends_by_name():
    """An FFN role stopped while idle (its service closes the connector from another thread):
    the wait for the next plan ends when the peer goes, as on the Python path, with an AFD error
    saying the connector closed (not a crash on what the close let go of)."""
    from test_attention_ride_through import in_thread

    a, f = gloo_pair()
    assert f._plans_served
    t, out = in_thread(f.recv_step)
    time.sleep(0.3)
    f.close()
    a.close()
    t.join(10)
    assert not t.is_alive()
    assert isinstance(out.get("error"), AFDPeerError), out
    assert "the connector closed while its compiled link was busy (wait" in str(out["error"])
