"""Hosts on one machine: network namespaces on a bridge, each with its own address and loopback.

Root only. Everything is named after this process (``afd<pid>``), removed on ``close()``, and a
leftover of an earlier run that died is removed before a new one is made. The bridge has an
address too, so the test process (in the root namespace) reaches every host's servers directly.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field

SUBNET = "10.231.0"  # private range (RFC 1918), used only inside the namespaces made here


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def our_netns() -> list[str]:
    """Namespaces of any run of this harness (for the leak check)."""
    out = ip("netns", "list", check=False).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.startswith("afd"))


@dataclass
class Hosts:
    count: int
    tag: str = field(default_factory=lambda: f"afd{os.getpid()}")

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
        return f"{SUBNET}.{10 + i}"

    def _veth(self, i: int) -> str:
        return f"{self.tag}v{i}"[:15]

    def _make(self) -> None:
        for ns in our_netns():  # an earlier run's, killed before it could clean up
            if not _alive(ns):
                ip("netns", "del", ns, check=False)
        ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", "del", self.bridge))
        ip("addr", "add", f"{SUBNET}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i in range(self.count):
            ns, veth = self.name(i), self._veth(i)
            ip("netns", "add", ns)
            self._made.append(("netns", "del", ns))
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._made.append(("link", "del", veth))
            ip("link", "set", veth, "master", self.bridge, "up")
            ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def wrap(self, i: int) -> list[str]:
        """The command prefix that runs a program on host ``i``."""
        return ["ip", "netns", "exec", self.name(i)]

    def cut(self, i: int) -> None:
        """Unplug host ``i``: its packets go nowhere, no connection is closed."""
        ip("link", "set", self._veth(i), "down")

    def restore(self, i: int) -> None:
        ip("link", "set", self._veth(i), "up")

    def close(self) -> None:
        while self._made:
            ip(*self._made.pop(), check=False)


def _alive(ns: str) -> bool:
    """Whether the run that made ``ns`` still runs (its pid is in the name)."""
    digits = ns[3:].split("h", 1)[0]
    return digits.isdigit() and os.path.exists(f"/proc/{digits}")
