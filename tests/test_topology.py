import pytest

from afd_common.topology import Topology, split_evenly

RATIOS = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2), (2, 3), (5, 3), (1, 4), (7, 7)]


@pytest.mark.parametrize("A,F", RATIOS)
def test_every_token_has_exactly_one_ffn_rank(A, F):
    topo = Topology(A, F)
    for a in range(A):
        links = topo.links_of_attention(a)
        assert links, f"attention rank {a} has no FFN peer"
        for n in (0, 1, 5, 17):
            assert sum(topo.chunk_rows(link, n) for link in links) == n
    for f in range(F):
        assert topo.links_of_ffn(f), f"FFN rank {f} serves nobody"
    assert topo.world_size == A + F
    assert sorted(topo.global_rank("attention", a) for a in range(A)) == list(range(A))
    assert sorted(topo.global_rank("ffn", f) for f in range(F)) == list(range(A, A + F))


def test_mapping_is_the_documented_one():
    assert [(link.attention_rank, link.ffn_rank) for link in Topology(3, 2).links] == \
        [(0, 0), (1, 1), (2, 0)]
    assert [(link.attention_rank, link.ffn_rank, link.chunk)
            for link in Topology(2, 3).links] == [(0, 0, 0), (0, 2, 1), (1, 1, 0)]


def test_split_evenly():
    assert split_evenly(5, 2) == [3, 2]
    assert split_evenly(0, 3) == [0, 0, 0]


def test_bad_ranks():
    with pytest.raises(ValueError):
        Topology(0, 1)
    with pytest.raises(ValueError, match="ffn rank 2"):
        Topology(1, 2).ffn_global_rank(2)
