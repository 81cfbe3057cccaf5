"""What travels with the hidden states: step metadata, per-layer call metadata and work items.

These are the dataclasses of the contract (``afd_common.contract``). They are plain data: the wire
format lives in ``afd_common.transport.codec`` and never pickles them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch

from afd_common.placement import ExpertPlacement

MAX_STAGES = 64

#: Makes one of the NamedTuples below from a tuple of all its fields, in C: for the per-layer
#: path, where a NamedTuple's Python-level ``__new__`` costs 0.3-0.8 us.
new_tuple = tuple.__new__


class StepKind(enum.IntEnum):
    RUN = 0  # any forward once serving: a scheduler step or an idle DP rank's dummy batch
    # 1 was a dummy step kind, never sent: dummy batches are steps like any other
    STOP = 2  # the attention side is shutting down; the FFN loop ends cleanly


@dataclass(frozen=True)
class StepMetadata:
    """Sent once per step on the control plane by every attention rank to each FFN peer.

    ``stage_tokens[s]`` is the number of tokens of micro-batch ``s`` on that attention rank
    (before any split over several FFN ranks). Carries everything the FFN side needs to post
    its receives for every MoE layer of the step.
    """

    step: int
    kind: StepKind
    stage_tokens: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stage_tokens)


class LayerCall(NamedTuple):
    """Which remote MoE call this is: the attention side's handle for a send/recv pair. A tuple:
    made, hashed and compared per layer on the path between a result and the next send, where a
    dataclass's Python-level ``__init__`` and ``__hash__`` cost microseconds."""

    layer_idx: int
    stage: int = 0


class WorkItemMeta(NamedTuple):
    """Metadata of one batch of rows the FFN side must run through one layer's experts.

    ``sources`` are ``(attention_rank, rows)`` in the order the rows are concatenated; the result
    is split back the same way. ``layer_idx`` comes from the FFN serving loop's schedule (sync
    connectors) or off the wire (async connectors, where the receive loop is the clock). A tuple,
    like ``LayerCall``: one is made per layer between the FFN role's send and its next wait.
    """

    layer_idx: int
    stage: int
    step: int
    sources: tuple[tuple[int, int], ...]
    is_stop: bool = False
    kind: StepKind = StepKind.RUN

    @property
    def num_tokens(self) -> int:
        sources = self.sources
        return sources[0][1] if len(sources) == 1 else sum(rows for _, rows in sources)


class WorkItem(NamedTuple):
    """One batch of rows for one layer's experts, as the FFN half received it. A tuple, like
    ``WorkItemMeta``: one is made per layer."""

    hidden_states: torch.Tensor
    meta: WorkItemMeta
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    #: Connector-private state needed to send the result back (e.g. CAM batch_info).
    handle: object | None = None

    @property
    def layer_idx(self) -> int:
        return self.meta.layer_idx

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens


@dataclass(frozen=True)
class ModelShape:
    """The shape facts both roles must agree on; also the base of the handshake fingerprint."""

    hidden_size: int
    dtype: torch.dtype
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int = 0
    top_k: int = 0
    architecture: str = ""
    max_num_tokens: int = 8192
    placement: ExpertPlacement = field(default_factory=ExpertPlacement)

    def check_layer(self, layer_idx: int) -> None:
        if layer_idx not in self._moe_set:
            raise ValueError(f"layer index {layer_idx} is not an MoE layer of this model "
                             f"(MoE layers: {_ranges(self.moe_layers)}, {self.num_layers} layers)")

    @cached_property
    def _moe_set(self) -> frozenset[int]:
        return frozenset(self.moe_layers)


def _ranges(xs: tuple[int, ...]) -> str:
    if not xs:
        return "none"
    if list(xs) == list(range(xs[0], xs[-1] + 1)):
        return f"{xs[0]}..{xs[-1]}"
    return ",".join(map(str, xs))
