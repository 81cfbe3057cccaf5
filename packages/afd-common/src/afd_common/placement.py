"""Which FFN rank holds routed expert ``e``: the one owner of that answer, for every connector.

Two placements, chosen by the FFN role's own vLLM flags (both roles are started with the same
flags, and the handshake compares the result):

* **replicated** (no ``--enable-expert-parallel``): every FFN rank holds every routed expert in
  full. vLLM would build the MoE layers of a DP > 1 role tensor-parallel over the DP ranks; afd
  builds them as if DP were 1 (``afd_common.vllm_glue.patches.moe_parallel``).
* **sharded** (``--enable-expert-parallel`` with more than one FFN rank): FFN rank ``f`` holds
  exactly the experts vLLM's expert parallelism gives EP rank ``f`` of ``F``
  (``--expert-placement-strategy`` linear or round_robin, uneven shares when ``F`` does not divide
  the expert count), loaded by vLLM's own weight loader. The attention side sends each token's
  rows only to the ranks that own one of its top-k experts and adds their partial results.

The rule is ours (afd-common depends on no vLLM); ``tests/test_placement.py`` checks it against
vLLM's ``determine_expert_map`` and the FFN role compares it with the expert map of every layer it
loaded, so the two cannot drift apart silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch

from afd_common.errors import AFDConfigError

Kind = Literal["replicated", "sharded"]
STRATEGIES = ("linear", "round_robin")


def effective_strategy(requested: str, num_expert_group: int | None) -> str:
    """vLLM's own fallback: round-robin placement only for models with several expert groups
    (DeepSeek-V3-style grouped routing); otherwise linear."""
    if requested not in STRATEGIES:
        raise AFDConfigError("--expert-placement-strategy", requested,
                             f"must be one of {', '.join(STRATEGIES)}")
    if requested == "round_robin" and not (num_expert_group or 0) > 1:
        return "linear"
    return requested


def expert_owners(num_experts: int, num_ranks: int, strategy: str) -> tuple[int, ...]:
    """Owner rank of each global expert under vLLM's EP placement: the first
    ``num_experts % num_ranks`` ranks get one expert more."""
    if num_ranks < 1 or num_experts < num_ranks:
        raise AFDConfigError("num_ffn_ranks", num_ranks,
                             f"sharding {num_experts} routed experts needs 1 <= num_ffn_ranks <= "
                             f"{num_experts}")
    if strategy == "round_robin":
        return tuple(e % num_ranks for e in range(num_experts))
    base, extra = divmod(num_experts, num_ranks)
    owners: list[int] = []
    for rank in range(num_ranks):
        owners += [rank] * (base + (1 if rank < extra else 0))
    return tuple(owners)


@dataclass(frozen=True)
class ExpertPlacement:
    kind: Kind = "replicated"
    num_experts: int = 0
    num_ffn_ranks: int = 1
    strategy: str = "linear"

    @property
    def sharded(self) -> bool:
        return self.kind == "sharded"

    @cached_property
    def owners(self) -> tuple[int, ...]:
        """Expert -> FFN rank; empty when replicated (every rank holds every expert)."""
        if not self.sharded:
            return ()
        return expert_owners(self.num_experts, self.num_ffn_ranks, self.strategy)

    def local_experts(self, ffn_rank: int) -> tuple[int, ...]:
        """The global ids FFN rank ``ffn_rank`` holds, in its local order (vLLM's order)."""
        if not self.sharded:
            return tuple(range(self.num_experts))
        return tuple(e for e, r in enumerate(self.owners) if r == ffn_rank)

    def expert_map(self, ffn_rank: int) -> torch.Tensor | None:
        """Global -> local expert index on ``ffn_rank`` (-1: held elsewhere), as vLLM's
        ``expert_map``; None when the rank holds every expert."""
        if not self.sharded:
            return None
        out = torch.full((self.num_experts,), -1, dtype=torch.int32)
        local = self.local_experts(ffn_rank)
        out[list(local)] = torch.arange(len(local), dtype=torch.int32)
        return out

    @cached_property
    def owner_table(self) -> torch.Tensor:
        """int64 [num_experts]: owner rank per expert, for routing rows in one gather."""
        return torch.tensor(self.owners, dtype=torch.int64)

    def describe(self) -> str:
        if not self.sharded:
            return f"replicated ({self.num_experts} routed experts on every FFN rank)"
        shares = [len(self.local_experts(f)) for f in range(self.num_ffn_ranks)]
        return (f"sharded over {self.num_ffn_ranks} FFN ranks ({self.strategy}): experts per "
                f"rank {shares}")

    def fingerprint(self) -> dict:
        return {"expert_placement": self.kind, "expert_placement_strategy": self.strategy,
                "expert_owners": list(self.owners)}


def placement_for(num_experts: int, num_ffn_ranks: int, enable_expert_parallel: bool,
                  strategy: str = "linear", num_expert_group: int | None = None
                  ) -> ExpertPlacement:
    """The placement a role started with these vLLM flags serves."""
    if not enable_expert_parallel or num_ffn_ranks == 1:
        return ExpertPlacement("replicated", num_experts, num_ffn_ranks)
    placement = ExpertPlacement("sharded", num_experts, num_ffn_ranks,
                                effective_strategy(strategy, num_expert_group))
    placement.owners  # noqa: B018 - refuse an impossible share now, before any group forms
    return placement
