"""Who talks to whom: the rank layout and the attention <-> FFN mapping for any A:F ratio.

P2P world layout (one process group spanning both roles)::

    global rank:  0 .. A-1          A .. A+F-1
                  attention a       FFN f  (global = A + f)

Mapping with *replicated* experts (every FFN rank holds all of them; the FFN side scales by serving
tokens):

* ``A >= F``: attention rank ``a`` talks to FFN rank ``a % F`` only. FFN rank ``f`` serves
  attention ranks ``f, f+F, f+2F, ...`` and runs their tokens as one batch (concatenated in
  attention-rank order). ``A % F != 0`` is fine: some FFN ranks serve one more attention rank.
* ``A < F``: FFN rank ``f`` serves attention rank ``f % A`` only. Attention rank ``a`` splits
  each micro-batch's tokens into contiguous, near-equal chunks, one per FFN rank ``a, a+A, ...``
  in that order (``split_evenly``), and concatenates the results back.

Both sides derive the split from the token counts on the control plane, so no chunk size is ever
sent twice.

With *sharded* experts (``afd_common.placement``) every attention rank talks to every FFN rank
(M2N): a row goes to the ranks that own one of its top-k experts, so how many rows cross a link is
known only once the layer's routing is (a row count precedes the rows on the wire).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


def split_evenly(n: int, parts: int) -> list[int]:
    """Contiguous chunk sizes: the first ``n % parts`` chunks get one extra row."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass(frozen=True)
class Link:
    """One attention rank's share of one FFN rank's batch."""

    attention_rank: int
    ffn_rank: int
    chunk: int  # index of this chunk among the attention rank's FFN peers
    num_chunks: int  # how many FFN ranks the attention rank splits its tokens over


@dataclass(frozen=True)
class Topology:
    num_attention_ranks: int
    num_ffn_ranks: int
    sharded: bool = False

    def __post_init__(self) -> None:
        if self.num_attention_ranks < 1 or self.num_ffn_ranks < 1:
            raise ValueError(f"topology needs >= 1 rank per role, got "
                             f"{self.num_attention_ranks}A{self.num_ffn_ranks}F")

    @property
    def world_size(self) -> int:
        return self.num_attention_ranks + self.num_ffn_ranks

    def attention_global_rank(self, a: int) -> int:
        self._check("attention", a, self.num_attention_ranks)
        return a

    def ffn_global_rank(self, f: int) -> int:
        self._check("ffn", f, self.num_ffn_ranks)
        return self.num_attention_ranks + f

    def global_rank(self, role: str, local_rank: int) -> int:
        if role == "attention":
            return self.attention_global_rank(local_rank)
        return self.ffn_global_rank(local_rank)

    @cached_property
    def links(self) -> tuple[Link, ...]:
        A, F = self.num_attention_ranks, self.num_ffn_ranks
        out = []
        if self.sharded:
            return tuple(Link(a, f, 0, 1) for a in range(A) for f in range(F))
        if A >= F:
            for a in range(A):
                out.append(Link(a, a % F, 0, 1))
        else:
            for a in range(A):
                peers = list(range(a, F, A))
                for i, f in enumerate(peers):
                    out.append(Link(a, f, i, len(peers)))
        return tuple(out)

    def links_of_attention(self, a: int) -> tuple[Link, ...]:
        """This attention rank's FFN peers, in chunk order."""
        self._check("attention", a, self.num_attention_ranks)
        return tuple(link for link in self.links if link.attention_rank == a)

    def links_of_ffn(self, f: int) -> tuple[Link, ...]:
        """The attention ranks this FFN rank serves, in batch (concatenation) order."""
        self._check("ffn", f, self.num_ffn_ranks)
        return tuple(link for link in self.links if link.ffn_rank == f)

    def chunk_rows(self, link: Link, num_tokens: int) -> int:
        """Rows of an attention rank's ``num_tokens`` that travel over ``link``."""
        if link.num_chunks == 1:  # the whole batch (read once per step and stage)
            return num_tokens
        return split_evenly(num_tokens, link.num_chunks)[link.chunk]

    def describe(self) -> str:
        pairs = ", ".join(f"a{link.attention_rank}->f{link.ffn_rank}"
                          + (f"[{link.chunk}/{link.num_chunks}]" if link.num_chunks > 1 else "")
                          for link in self.links)
        kind = ", experts sharded (M2N)" if self.sharded else ""
        return f"{self.num_attention_ranks}A{self.num_ffn_ranks}F{kind}: {pairs}"

    @staticmethod
    def _check(role: str, rank: int, size: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"{role} rank {rank} out of range [0, {size})")
