"""The hosts harness (afd_common.tools.bench.hosts) that afd-bench --hosts and the multi-host e2e
tests stand on: namespaces with their own addresses, a capped link really runs at its cap in both
directions, a cut link carries nothing, and nothing is left behind. Root only; never skipped."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from afd_common.tools.bench.hosts import Hosts, ip, our_netns, rate_bits
from afd_common.tools.launch import free_port

PAYLOAD = 2_500_000  # bytes: 1 s at 20 Mbit/s
SINK = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 16)
    if not b: break
    n += len(b)
print(n, flush=True)
"""
SOURCE = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.sendall(b"x" * int(sys.argv[3])); s.close()
"""


def _send(hosts: Hosts, src: int, dst: int) -> float:
    """Seconds to move PAYLOAD bytes from host ``src`` to host ``dst`` over TCP."""
    port = free_port()
    sink = subprocess.Popen([*hosts.wrap(dst), sys.executable, "-c", SINK, hosts.address(dst),
                             str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout.readline().strip() == "ready"
        start = time.monotonic()
        subprocess.run([*hosts.wrap(src), sys.executable, "-c", SOURCE, hosts.address(dst),
                        str(port), str(PAYLOAD)], check=True, timeout=60)
        assert int(sink.stdout.readline()) == PAYLOAD
        return time.monotonic() - start
    finally:
        sink.kill()
        sink.wait()


@pytest.fixture
def two_hosts():
    hosts = Hosts(2)
    try:
        yield hosts
    finally:
        hosts.close()
        assert not hosts.leftovers()


def test_a_capped_link_runs_at_its_cap_both_ways_and_uncapped_far_faster(two_hosts):
    cap = "20mbit"
    free = _send(two_hosts, 0, 1)
    two_hosts.cap(1, cap)
    into, out = _send(two_hosts, 0, 1), _send(two_hosts, 1, 0)
    two_hosts.cap(1, None)
    again = _send(two_hosts, 0, 1)
    ideal = PAYLOAD * 8 / rate_bits(cap)
    print(f"{PAYLOAD} B: uncapped {free:.2f} s, capped at {cap} in {into:.2f} s / out "
          f"{out:.2f} s (ideal {ideal:.2f} s), cap lifted {again:.2f} s")
    for took in (into, out):
        assert 0.8 * ideal <= took <= 2.0 * ideal, took
    assert max(free, again) < ideal / 3


def test_a_cut_link_carries_nothing_until_restored(two_hosts):
    probe = ("import socket,sys\ntry:\n    socket.create_connection((sys.argv[1], 9), timeout=2)"
             "\nexcept ConnectionRefusedError:\n    sys.exit(0)\nexcept OSError:\n    sys.exit(1)")
    reach = lambda: subprocess.run([*two_hosts.wrap(0), sys.executable, "-c", probe,  # noqa: E731
                                    two_hosts.address(1)], timeout=30).returncode == 0
    assert reach(), "an unused port on a reachable host refuses at once"
    two_hosts.cut(1)
    assert not reach()
    two_hosts.restore(1)
    assert reach()


@pytest.mark.parametrize("rate, bits", [("100mbit", 1e8), ("1gbit", 1e9), ("2.5Gbit", 2.5e9),
                                        ("800kbit", 8e5)])
def test_rates_read_as_tc_writes_them(rate, bits):
    assert rate_bits(rate) == bits


@pytest.mark.parametrize("rate", ["fast", "100", "10 mbit", "0mbit", "1tbit"])
def test_a_bad_rate_is_refused_by_value(rate):
    with pytest.raises(ValueError, match=rate.replace(" ", ".")):
        rate_bits(rate)


def test_harnesses_alive_at_once_share_no_name_or_subnet(two_hosts):
    """One process may hold several (the e2e session's hosts and a test's own): each has its own
    names and its own subnet, so neither clashes with nor reroutes the other."""
    other = Hosts(1)
    try:
        assert other.name(0) not in (two_hosts.name(0), two_hosts.name(1))
        assert other.address(0).rsplit(".", 1)[0] != two_hosts.address(0).rsplit(".", 1)[0]
        assert _send(two_hosts, 0, 1) < 5
    finally:
        other.close()
    assert not other.leftovers()


def test_a_dead_runs_leftovers_are_removed_and_not_counted_as_ours():
    """A run killed before its clean-up leaves namespaces and a bridge; the next run removes
    them, and its own leak check is about its own names only (CI once failed on exactly this:
    the check compared against a list that still held a dead run's namespaces)."""
    dead = next(p for p in range(4_000_000, 4_100_000) if not os.path.exists(f"/proc/{p}"))
    stale_ns, stale_br = f"afd{dead}x0h0", f"afd{dead}x0br"
    ip("netns", "add", stale_ns)
    ip("link", "add", stale_br, "type", "bridge")
    try:
        hosts = Hosts(1)
        hosts.close()
        assert stale_ns not in our_netns()
        assert stale_br not in ip("-o", "link", "show").stdout
        assert not hosts.leftovers()
    finally:
        ip("netns", "del", stale_ns, check=False)
        ip("link", "del", stale_br, check=False)
