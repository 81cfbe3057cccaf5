"""FFN half of ``P2pAFDConnector`` (alias ``P2pNcclAFDConnector``).

Driven by the scheduled loop: the control plane says how many rows each served attention rank has per
stage, so every receive is posted with its exact size (but for the compiled link's first of a
step, below). With sharded experts that is an upper
bound: each attention rank's row count for this layer comes first, and a count above the bound is
refused before anything is allocated. Rank layout and the A:F mapping: ``afd_common.topology``;
message layout and the order on a link: ``afd_common.transport.p2p``.

Each (layer, stage)'s receives are posted as soon as the previous result is sent (the first
one's when the step's plan arrives), not when the loop asks for them: Gloo holds back a send whose
receive is not posted yet and moves the data only after a second notification round trip, so a
receive posted late costs a round trip per layer. Where one source sends each (layer, stage),
everything that send and that post need is prepared while the rows are awaited (``Ready``), and
the post goes out in the same call as the send (``PeerIO.send_then_post``): the peer's next rows
race with it. The order of operations on every link stays the one ``p2p`` lists (it is only
earlier in time), so in-order transports (NCCL, HCCL) are as safe as before.

Where one attention rank over Gloo sends this rank all its rows, every step is served by the
compiled link (``afd_common.transport.one_link``), which does the same in the same order and
posts one receive more: the next step's first, with the step's last result. The peer sends a
step's plan and its first rows back to back; posted only once the plan is decoded, that receive
cost the rows a notification round trip. It is sized by max_num_tokens (every plan is held to
it): Gloo takes a shorter message into a receive without saying how long it was -- into an
exactly sized one too, so the size never checked a message against its plan -- and a longer
one aborts the receiving process (an enforce in Gloo's I/O thread), whatever the receive's
size. Measured (``benchmarks/transport.py``, six runs pairing alternate steps with and without
it): the first layer 10-25 us shorter at 1-16 tokens in every run. The Python here
serves every other case and names what is wrong with a call the compiled link refuses.

On the Python path the next step's first receive waits for its plan. Posting it earlier there
(sized the same way) was measured slower at every size, steady layers included (median of five
alternating runs of ``benchmarks/transport.py``, before the path was compiled: 1.72 -> 1.51x
raw at 1 token, 1.44 -> 1.33x at 16, 1.37 -> 1.29x at 128).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from afd_common.errors import AFDProtocolError
from afd_common.metadata import StepKind, StepMetadata, WorkItem, WorkItemMeta, new_tuple
from afd_common.transport import codec
from afd_common.transport.control_plane import CONTROL_TAG, decoded
from afd_common.transport import one_link
from afd_common.transport.one_link import LinkError
from afd_common.transport.p2p import (PROTOCOL, DataTags, ReceiveBuffers, count_tag,
                                      open_p2p_world, unpack)
from afd_common.contract import ScheduledFFNConnector, StepPlan


class Posted(NamedTuple):
    """The receives of one (layer, stage), posted: per source (attention rank, rows or, with
    sharded experts, the announced bound, the posted receive of its rows or row count)."""

    layer_idx: int
    stage: int
    receives: tuple


class Ready(NamedTuple):
    """A one-source item's answer, prepared while its rows were awaited (idle time on the round
    trip's path): the result's expected shape, where it goes, and the receive of the (layer,
    stage) the loop serves next -- one source's rows into their buffer, posted right after that
    send (``PeerIO.send_then_post``) -- or None where the step has no next."""

    meta: WorkItemMeta  # the item's, by identity
    shape: tuple[int, int]
    dst: int
    tag: int
    next: NextRows | None


class NextRows(NamedTuple):
    layer_idx: int
    stage: int
    source: int  # attention rank (local)
    rows: int
    buf: torch.Tensor
    src: int  # its global rank
    tag: int
    what: tuple


def _posted(nxt: NextRows, pending) -> Posted:
    return new_tuple(Posted, (nxt.layer_idx, nxt.stage, ((nxt.source, nxt.rows, pending),)))


class P2pFFNConnector(ScheduledFFNConnector):
    protocol = PROTOCOL
    backend: str | None = None  # the configured one (open_p2p_world)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        layers = self.shape.moe_layers
        self._next_layer = dict(zip(layers, layers[1:]))
        self._first_layer = layers[0] if layers else None
        self._posted: Posted | None = None
        self._global = {link.attention_rank: self.topology.attention_global_rank(
            link.attention_rank) for link in self._links}
        self._sharded, self._gate = self.topology.sharded, self.config.compute_gate_on_attention
        # The attention rank (global) that sends this rank all its rows, if one does and the
        # routing is computed here: where the compiled link can serve (one_link).
        one = len(self._links) == 1 and not self._sharded and not self._gate
        self._one_src = self._global[self._links[0].attention_rank] if one else None
        self._hidden_size, self._dtype = self.shape.hidden_size, self.shape.dtype
        # What posts a (layer, stage)'s receives: its rows, or with sharded experts their counts.
        self._post = self._post_counts if self._sharded else self._post_rows
        self._tags = DataTags()
        self._kind = StepKind.RUN  # the current step's
        # The one-source path compiled, where it can serve (afd_common.transport.one_link), and
        # whether it serves the current step (every step with a MoE layer and a stage).
        self._compiled, self._compiled_step = None, False
        self._plans_served = False  # whether the compiled link receives the plans too

    def _open(self):
        # Nothing posted on a world that is gone is waited on.
        self._posted, self._ready, self._frame_due = None, None, False
        shape = self.shape
        self._buffers = ReceiveBuffers(shape.hidden_size, shape.dtype, shape.top_k, self._gate,
                                       self.device)
        net = open_p2p_world(self, self.backend)
        if self._one_src is not None:
            link = self._compiled = one_link.ffn_link(net.data, self._one_src, shape)
            if link is not None:
                # The plans too, where the control plane's frames share the rows' group and
                # come from the one attention rank, all of whose rows come here (a plan's
                # counts are this link's rows).
                self._plans_served = (net.control.io is net.data
                                      and list(net.control.peers) == [self._one_src]
                                      and self._links[0].num_chunks == 1)
                one_link.serve(self, link, self._failure_from, WorkItem, WorkItemMeta,
                               self._post_frame, CONTROL_TAG if self._plans_served else -1,
                               StepMetadata, self._plan_failure, *codec.STEP_FRAME, StepPlan,
                               {k.value: k for k in StepKind}, StepKind.STOP.value,
                               self._links[0].attention_rank, self._take_plan)
        self._compiled_step = False
        return net

    def _take_plan(self, frame: torch.Tensor) -> StepPlan:
        """A plan the compiled link received and does not take (a STOP, a plan to refuse):
        decoded, checked and begun as the control plane's receiver would."""
        meta = decoded(self._one_src, memoryview(frame.numpy()))
        return self._begin_plan(StepPlan(meta.step, {self._links[0].attention_rank: meta}))

    def _plan_failure(self, e: LinkError, *where) -> Exception:
        """A failure of the compiled link's ``recv_step``: waiting for the plan, or posting the
        step's first receive (``where``: its layer and stage)."""
        if where:
            return self._link_failure(e, *where)
        return one_link.failure(self._net, e, self._one_src, "the next step's metadata",
                                None)

    def recv_step(self):
        posted = self._posted
        if posted is None and self._compiled_step:
            posted = self._compiled.expected()
        if posted is not None:  # the loop left a step before serving all of it
            raise RuntimeError(f"the next step is asked for while layer {posted[0]} stage "
                               f"{posted[1]} of step {self._plan.step} is unserved")
        return super().recv_step()

    def _post_first(self):
        self._kind, self._ready = self._plan.kind, None
        compiled = self._compiled
        if compiled is not None:
            self._compiled_step = False  # unless it takes the step
            plan = self._plan
            try:
                self._compiled_step = compiled.begin([n for (_, n), in self._sources], plan.step,
                                                     self._kind, self._sources)
            except LinkError as e:
                raise self._link_failure(e, self._first_layer, 0) from None
            if self._compiled_step:
                # It posts the next plans' receive: the control plane's after the first answer,
                # as below; its own in its next recv_step.
                return
        if self._first_layer is not None and self._sources:
            self._posted = self._post(self._first_layer, 0, self._sources[0])
            # Between this and the step's first wait it would delay rows that are likely in
            # already: posted after the step's first send instead.
            self._frame_due = True
        else:
            self._post_plans()

    def recv_layer(self, stage_idx, layer_idx, max_num_tokens=None) -> WorkItem:
        if self._compiled_step:  # inline: a call more costs a cold frame on the round trip
            if max_num_tokens is not None:
                self._stage_sources(stage_idx, max_num_tokens, layer_idx)
            try:
                hidden = self._compiled.recv(stage_idx, layer_idx, self.timeouts.current_s)
            except LinkError as e:
                raise self._failure_from(e, layer_idx, stage_idx) from None
            if hidden is None:
                self._not_next(stage_idx, layer_idx)
            return new_tuple(WorkItem, (hidden, new_tuple(WorkItemMeta, (
                layer_idx, stage_idx, self._plan.step, self._sources[stage_idx], False,
                self._kind)), None, None, None))
        posted, self._posted = self._posted, None
        net = self._net
        if (posted is None or posted.layer_idx != layer_idx or posted.stage != stage_idx
                or net is None):
            self._require_net()
            sources = self._stage_sources(stage_idx, max_num_tokens, layer_idx)
            if posted is not None:
                raise RuntimeError(
                    f"recv_layer(layer {layer_idx}, stage {stage_idx}) while layer "
                    f"{posted.layer_idx} stage {posted.stage} is next: the scheduled loop serves "
                    "the MoE layers in order, each layer's stages in order")
            posted = self._post(layer_idx, stage_idx, sources)
        elif max_num_tokens is not None:
            # The one posted: its layer and stage were checked when the step began.
            self._stage_sources(stage_idx, max_num_tokens, layer_idx)
        receives = posted.receives
        if self._sharded:
            sources, receives = self._post_routed(receives, layer_idx, stage_idx)
        else:
            sources = self._sources[stage_idx]
        # The item is made before waiting: after the data lands only the waits stand between it
        # and the experts.
        meta = new_tuple(WorkItemMeta, (layer_idx, stage_idx, self._plan.step, sources, False,
                                        self._kind))
        if len(receives) == 1 and not self._gate:  # one source's rows, used where they land
            a, n, pending = receives[0]
            item = new_tuple(WorkItem, (pending.tensor, meta, None, None, None))
            if not self._sharded:
                self._ready = self._prepare(meta, a, n)
            net.data.wait(pending, self.timeouts.current_s)
            return item
        shape = self.shape
        parts = [unpack(p.tensor, n, shape.hidden_size, shape.dtype, shape.top_k, self._gate)
                 for _, n, p in receives]
        data, timeout = net.data, self.timeouts.current_s
        for _, _, p in receives:
            data.wait(p, timeout)
        if len(parts) == 1:
            hidden, ids, weights = parts[0]
        elif parts:
            hidden = torch.cat([p[0] for p in parts])
            ids = torch.cat([p[1] for p in parts]) if self._gate else None
            weights = torch.cat([p[2] for p in parts]) if self._gate else None
        else:
            hidden = torch.empty(0, shape.hidden_size, dtype=shape.dtype, device=self.device)
            ids = (torch.empty(0, shape.top_k, dtype=torch.int32, device=self.device)
                   if self._gate else None)
            weights = (torch.empty(0, shape.top_k, dtype=torch.float32, device=self.device)
                       if self._gate else None)
        return self.work_item(hidden, meta, ids, weights)

    def _post_counts(self, layer_idx: int, stage_idx: int, sources) -> Posted:
        """Post the receives of (layer, stage) with sharded experts: every source's row count."""
        net = self._net
        what = ("the row count of layer {} stage {}", layer_idx, stage_idx)
        ctag = count_tag(layer_idx, stage_idx)
        # On the data plane's device (NCCL moves device tensors); reading it back is the one host
        # sync a sharded layer needs: the rows' receive is posted with their size.
        return Posted(layer_idx, stage_idx, tuple(
            (a, bound, net.data.irecv(self._buffers.count(stage_idx, a), self._global[a], ctag,
                                      what))
            for a, bound in sources))

    def _post_rows(self, layer_idx: int, stage_idx: int, sources) -> Posted:
        """Post the receives of (layer, stage): the rows of each source that has any."""
        data = self._net.data
        if len(sources) == 1:  # one source: no list to build, once per layer and stage
            a, n = sources[0]
            return new_tuple(Posted, (layer_idx, stage_idx, ((a, n, data.irecv(
                *self._rows_receive(layer_idx, stage_idx, a, n))),) if n else ()))
        posted = []
        for a, n in sources:
            if n:
                posted.append((a, n, data.irecv(*self._rows_receive(layer_idx, stage_idx, a,
                                                                     n))))
        return new_tuple(Posted, (layer_idx, stage_idx, tuple(posted)))

    def _rows_receive(self, layer_idx: int, stage_idx: int, source: int, rows: int) -> tuple:
        """``PeerIO.irecv``'s arguments for ``rows`` rows of (layer, stage) from ``source``:
        the ring's next buffer (ReceiveBuffers), the global rank, the tag, what an error
        names."""
        return (self._buffers.message(stage_idx, source, rows), self._global[source],
                self._tags[layer_idx, stage_idx],
                ("hidden states of layer {} stage {}", layer_idx, stage_idx))

    def _post_routed(self, counts, layer_idx: int, stage_idx: int):
        """(attention rank, rows routed here) for this layer, each checked against the rows that
        rank announced for the stage, and the receives of those rows."""
        data, timeout = self._net.data, self.timeouts.current_s
        sources = []
        for a, bound, pending in counts:
            n = int(data.wait(pending, timeout)[0])
            if not 0 <= n <= bound:
                raise AFDProtocolError(
                    f"attention rank {a} announced {n} rows for layer {layer_idx} stage "
                    f"{stage_idx}, outside [0, {bound}] (its tokens in this stage)")
            sources.append((a, n))
        sources = tuple(sources)
        return sources, self._post_rows(layer_idx, stage_idx, sources).receives

    def send_ffn_output(self, output: torch.Tensor, item: WorkItem) -> None:
        meta = item.meta
        if self._compiled_step:
            try:
                sent = self._compiled.send(output, meta.stage, meta.layer_idx)
            except LinkError as e:
                raise self._failure_from(e, meta.layer_idx, meta.stage) from None
            if not sent:
                self._refused_output(output, meta)
            return
        ready = self._ready
        if (ready is not None and ready.meta is meta and output.shape == ready.shape
                and output.dtype == self._dtype and output.is_contiguous()
                and self._posted is None and self._net is not None):
            # As prepared, checked in one condition: this is the path from the rows' arrival
            # to the result's send, where each line costs (contract._check_send).
            self._ready = None
            nxt = ready.next
            if nxt is None:
                self._net.data.isend(output, ready.dst, ready.tag)
            else:
                self._posted = _posted(nxt, self._net.data.send_then_post(
                    output, ready.dst, ready.tag, nxt.buf, nxt.src, nxt.tag, nxt.what))
            if self._frame_due:
                self._post_frame()
            return
        self._check_output(output, meta.num_tokens)
        data, tag = self._net.data, self._tags[meta.layer_idx, meta.stage]
        output = output.contiguous()
        start = 0
        for a, n in meta.sources:
            if n:
                data.isend(output[start:start + n], self._global[a], tag)
                start += n
        self._post_next(meta.layer_idx, meta.stage)

    def _next_of(self, layer_idx: int, stage_idx: int) -> tuple[int, int] | None:
        """The (layer, stage) the loop serves after this one in the step, if any."""
        stage = stage_idx + 1
        if stage < len(self._sources):
            return layer_idx, stage
        layer_idx = self._next_layer.get(layer_idx)
        return None if layer_idx is None else (layer_idx, 0)

    def _prepare(self, meta: WorkItemMeta, source: int, rows: int) -> Ready | None:
        """A one-source item's ``Ready``, unless the next (layer, stage) has several sources or
        none with rows (those take the general path)."""
        layer, stage = meta.layer_idx, meta.stage
        nxt = self._next_of(layer, stage)
        if nxt is not None:
            sources = self._sources[nxt[1]]
            if len(sources) != 1 or not sources[0][1]:
                return None
            a, n = sources[0]
            nxt = new_tuple(NextRows, (*nxt, a, n, *self._rows_receive(*nxt, a, n)))
        return new_tuple(Ready, (meta, (rows, self._hidden_size), self._global[source],
                                 self._tags[layer, stage], nxt))

    def _post_next(self, layer_idx: int, stage_idx: int) -> None:
        """Post the receives of the (layer, stage) the loop serves next in this step, if any."""
        ready, self._ready = self._ready, None
        if self._posted is not None:
            return  # an item served twice: its successor is posted already
        if ready is not None and ready.meta[:2] == (layer_idx, stage_idx):
            nxt = ready.next  # into the buffer the ring turned to for it (ReceiveBuffers)
            if nxt is not None:
                self._posted = _posted(nxt, self._net.data.irecv(nxt.buf, nxt.src, nxt.tag,
                                                                 nxt.what))
        else:
            nxt = self._next_of(layer_idx, stage_idx)
            if nxt is not None:
                self._posted = self._post(*nxt, self._sources[nxt[1]])
        if self._frame_due:
            self._post_frame()

    def _post_frame(self) -> None:
        self._frame_due = False
        self._post_plans()

    def _post_plans(self) -> None:
        """The receives of the next steps' plans, by whichever receives them."""
        if self._plans_served:
            self._compiled.post_plans()
        else:
            self._net.control.post_next()

    def _not_next(self, stage_idx: int, layer_idx: int) -> None:
        """Why the compiled link refused ``recv_layer``: a bad call, or not the one next."""
        self._stage_sources(stage_idx, None, layer_idx)
        raise RuntimeError(f"recv_layer(layer {layer_idx}, stage {stage_idx}) while "
                           f"{self._compiled_position()}: the scheduled loop serves the MoE "
                           "layers in order, each layer's stages in order")

    def _refused_output(self, output: torch.Tensor, meta: WorkItemMeta) -> None:
        """Why the compiled link refused a result: its shape, or not the item being served."""
        self._check_output(output, meta.num_tokens)
        raise RuntimeError(f"send_ffn_output for layer {meta.layer_idx} stage {meta.stage} of "
                           f"step {meta.step} while {self._compiled_position()}: each item's "
                           "result is sent once, in the order served")

    def _compiled_position(self) -> str:
        expected = self._compiled.expected()
        if expected is None:
            return f"step {self._plan.step} is served"
        layer, stage, serving = expected
        return f"layer {layer} stage {stage} is {'being served' if serving else 'next'}"

    def _failure_from(self, e: LinkError, layer_idx: int, stage_idx: int) -> Exception:
        """A failure of the compiled link while serving (layer, stage): a failed post is the next
        item's receive (or the next step's first)."""
        if e.args[0] == "post":
            layer_idx, stage_idx = (self._next_of(layer_idx, stage_idx)
                                    or (self._first_layer, 0))
        return self._link_failure(e, layer_idx, stage_idx)

    def _link_failure(self, e: LinkError, layer_idx: int, stage_idx: int) -> Exception:
        return one_link.failure(self._net, e, self._one_src,
                                ("hidden states of layer {} stage {}", layer_idx, stage_idx),
                                self.timeouts.current_s)

    def _release(self, net) -> None:
        compiled, self._compiled, self._compiled_step = self._compiled, None, False
        self._plans_served = False
        if compiled is not None:
            one_link.unserve(self)
            try:  # before drop(), which lets go of the sends
                compiled.flush(min(5.0, self.timeouts.step_s))
            except Exception:  # noqa: BLE001 - the peer may be gone; closing must not fail
                pass
            compiled.drop()
        super()._release(net)
