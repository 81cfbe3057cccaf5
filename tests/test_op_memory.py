"""The portable afd_ascend kernels free what they sent once the peer has it: memory stays flat
over many steps through both CAM connectors (spawned ranks over Gloo).

A Gloo send completes only after the peer posted its receive, and reports it only when waited
on; the kernels used to keep every sent tensor until 4,096 of them were pending per group
(gigabytes at real hidden sizes). Each step here sends ~1 MiB per layer and rank, so keeping
the sends of 40 steps would grow every rank by tens of MiB."""

import pytest

from afd_common.tools.selftest import Spec, run_world

pytestmark = pytest.mark.multiproc

STEPS, LAYERS, HIDDEN = 40, 4, 65536  # up to 5 rows of 256 KiB per send
# Measured on 2 cores: with every send kept, each rank grew by 217-420 MiB; with the sends
# released, by -7 to 24 MiB (receive buffers and the allocator's caching vary between runs).
FLAT_MIB = 60


@pytest.mark.parametrize("connector,A,F,stages", [
    ("CAMP2pAFDConnector", 2, 2, 2),     # sharded: M2N, and two stage groups
    ("CAMAsyncAFDConnector", 2, 2, 1),   # the FFN side frees per attention rank
])
def test_memory_of_every_rank_stays_flat_over_many_steps(connector, A, F, stages):
    spec = Spec(A, F, connector=connector, steps=STEPS, num_layers=LAYERS, stages=stages,
                hidden_size=HIDDEN, gate_on_attention=True, sharded=True, timeout_s=60)
    results = run_world(spec, deadline_s=240)
    bad = [f"{r.role} {r.rank}: {r.status} {r.detail}" for r in results if r.status != "ok"]
    assert not bad, "\n".join(bad)
    growth = {(r.role, r.rank): r.detail["rss_growth_mib"] for r in results}
    print(f"{connector}: RSS growth after the first step, MiB: {growth}")
    assert all(g is not None and g < FLAT_MIB for g in growth.values()), growth
