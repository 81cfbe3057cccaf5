"""Hosts on one machine: network namespaces on a bridge, each with its own address and loopback.

For ``afd-bench --hosts`` and the multi-host tests. Root only. Everything is named after this
process (``afd<pid>``), removed on ``close()``, and a leftover of an earlier run that died is
removed before a new one is made. The bridge has an address too, so this process (in the root
namespace) reaches every host's servers directly. A host's link can be capped (``tc`` token
bucket on both ends of its veth: each end shapes what it sends) and cut.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

# Private range (RFC 1918), used only inside the namespaces made here: 10.231.X.0/24, a third
# octet of its own per instance, so instances alive at once never share a route.
SUBNET_PREFIX = "10.231"
IFNAME = "eth0"  # each host's interface on the bridge
LOCK_PATH = os.path.join(tempfile.gettempdir(), "afd-hosts.lock")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


_instances = itertools.count()
RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)bit$")


def rate_bits(rate: str) -> float:
    """``tc``'s rate syntax as bits per second: "100mbit" -> 1e8. ValueError names the rate."""
    match = RATE.match(rate.strip().lower())
    if not match:
        raise ValueError(f"bandwidth {rate!r}: write it as tc does, e.g. 100mbit, 1gbit, 10gbit")
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    if value <= 0:
        raise ValueError(f"bandwidth {rate!r} must be > 0")
    return value


def our_netns() -> list[str]:
    """Namespaces of any run of this harness, alive or dead."""
    out = ip("netns", "list", check=False).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.startswith("afd"))


@dataclass
class Hosts:
    count: int
    # afd<pid>x<n>: unique per instance (one process may hold several, e.g. a test session's
    # hosts and a test's own), and names the process that made it. At most 15 characters with
    # "br" or "v<i>" appended (Linux's limit on interface names).
    tag: str = field(default_factory=lambda: f"afd{os.getpid()}x{next(_instances)}")

    def __post_init__(self):
        if os.geteuid() != 0:
            raise RuntimeError("the multi-host tests create network namespaces: run them as root")
        self.bridge = f"{self.tag}br"[:15]
        self._made: list[tuple[str, ...]] = []  # undo commands, newest last
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def name(self, i: int) -> str:
        return f"{self.tag}h{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def _veth(self, i: int) -> str:
        return f"{self.tag}v{i}"[:15]

    def _make(self) -> None:
        # Harnesses made at once (test workers side by side) would read the same free subnet.
        with open(LOCK_PATH, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._make_locked()

    def _make_locked(self) -> None:
        for ns in our_netns():  # an earlier run's, killed before it could clean up
            if not _alive(ns):
                ip("netns", "del", ns, check=False)
        for bridge in _our_bridges():  # its bridge too
            if not _alive(bridge):
                ip("link", "del", bridge, check=False)
        used = set(re.findall(rf"inet {SUBNET_PREFIX}\.(\d+)\.", ip("-o", "addr", "show").stdout))
        self.subnet = f"{SUBNET_PREFIX}.{next(n for n in range(256) if str(n) not in used)}"
        ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", "del", self.bridge))
        ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i in range(self.count):
            ns, veth = self.name(i), self._veth(i)
            ip("netns", "add", ns)
            self._made.append(("netns", "del", ns))
            ip("link", "add", veth, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            self._made.append(("link", "del", veth))
            ip("link", "set", veth, "master", self.bridge, "up")
            ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFNAME)
            ip("-n", ns, "link", "set", IFNAME, "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def env(self, i: int, data_parallel: bool) -> dict[str, str]:
        """What a vLLM process on host ``i`` needs: its own address for vLLM and, for a DP rank,
        vLLM's Gloo DP group bound to its interface (``GLOO_SOCKET_IFNAME``; afd's groups then
        bind it too). The namespaces share this machine's hostname, which resolves to 127.0.0.1,
        Gloo's default. Without DP, afd finds the interface itself (the route to ``host``)."""
        env = {"VLLM_HOST_IP": self.address(i)}
        return {**env, "GLOO_SOCKET_IFNAME": IFNAME} if data_parallel else env

    def wrap(self, i: int) -> list[str]:
        """The command prefix that runs a program on host ``i``."""
        return ["ip", "netns", "exec", self.name(i)]

    def cap(self, i: int, rate: str | None) -> None:
        """Cap host ``i``'s link at ``rate`` (tc syntax, e.g. "1gbit") in both directions; None
        lifts the cap. The bucket holds 10 ms of traffic (at least 64 KiB), the queue 50 ms."""
        for netns, dev in ((None, self._veth(i)), (self.name(i), IFNAME)):
            tc = ["tc", *(["-n", netns] if netns else []), "qdisc"]
            if rate is None:
                subprocess.run([*tc, "del", "dev", dev, "root"], capture_output=True)
                continue
            burst = max(64 * 1024, int(rate_bits(rate) / 8 / 100))
            subprocess.run([*tc, "replace", "dev", dev, "root", "tbf", "rate", rate, "burst",
                            str(burst), "latency", "50ms"], capture_output=True, text=True,
                           check=True)

    def cut(self, i: int) -> None:
        """Unplug host ``i``: its packets go nowhere, no connection is closed."""
        ip("link", "set", self._veth(i), "down")

    def restore(self, i: int) -> None:
        ip("link", "set", self._veth(i), "up")

    def close(self) -> None:
        while self._made:
            ip(*self._made.pop(), check=False)

    def leftovers(self) -> list[str]:
        """This instance's namespaces and bridge still present (none after ``close()``). Only its
        own: a dead run's leftovers, removed when this one was made, are not its to report."""
        return [n for n in our_netns() + _our_bridges() if n.startswith(self.tag)]


def _our_bridges() -> list[str]:
    out = ip("-o", "link", "show", "type", "bridge", check=False).stdout
    names = (line.split(":")[1].strip() for line in out.splitlines() if ":" in line)
    return [n for n in names if n.startswith("afd") and n.endswith("br")]


def _alive(name: str) -> bool:
    """Whether the run that made ``name`` (a namespace or bridge) still runs: its pid is in it."""
    digits = name[3:].split("x", 1)[0]
    return digits.isdigit() and os.path.exists(f"/proc/{digits}")
