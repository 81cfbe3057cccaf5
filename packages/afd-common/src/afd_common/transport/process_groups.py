"""Process groups of our own over torch.distributed: rendezvous, signed entries, groups.

Each role is a vLLM instance that already owns torch.distributed's default group, so AFD never
touches it: the connector builds its own store and its own process groups (Gloo on CPU, NCCL on
CUDA, HCCL on NPU) from the c10d classes directly. The rendezvous socket is bound by us to the
configured host only and handed to the TCPStore. What moves over a group once it is formed:
``afd_common.transport.peer_io``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import math
import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from afd_common.errors import AFDPeerError, AFDTimeoutError
from afd_common.transport.peer_io import backend_name

logger = logging.getLogger("vllm.afd")

# Waiting for a peer to turn up may last as long as a checkpoint loads: a line every 30 s.
CONNECT_PROGRESS_EVERY_S = 30.0


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _listen_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise AFDPeerError(f"cannot bind the AFD rendezvous to {host}:{port}: {e} "
                           "(is another AFD role or process using this port?)") from None
    sock.listen(128)
    return sock


class Rendezvous:
    """A TCPStore for one AFD world. The FFN rank 0 hosts it; everyone else connects.

    Connecting retries in short slices so a long wait for the other role prints progress instead
    of looking like a hang. ``connect_timeout_s`` None waits as long as it takes (the FFN role may
    still be loading its checkpoint); a number gives up with a clear error at the deadline.
    ``timeout_s`` bounds each store operation once connected.
    """

    def __init__(self, host: str, port: int, is_master: bool, timeout_s: float, what: str,
                 connect_timeout_s: float | None = None,
                 cancel: threading.Event | None = None):
        """``cancel`` set (from another thread) ends a wait for the peers with AFDPeerError."""
        self.host, self.port = host, port
        self.cancel = cancel
        start = time.monotonic()
        if is_master:
            sock = _listen_socket(host, port)
            try:
                self.store = dist.TCPStore(host, port, None, True, timedelta(seconds=timeout_s),
                                           wait_for_workers=False, master_listen_fd=sock.fileno())
            except BaseException:
                sock.close()
                raise
            # The store's server owns the socket now and closes it when the store goes: closing
            # it here too would close whatever file reused the number by then.
            sock.detach()
            return
        limit = math.inf if connect_timeout_s is None else connect_timeout_s
        last_log = start
        while True:
            self.check_cancelled(what)
            left = limit - (time.monotonic() - start)
            try:
                # A plain connect first: a TCPStore client that finds nobody there logs a C++
                # stack trace per attempt, a wall of them over a long wait for the other role.
                socket.create_connection((host, port), timeout=max(0.5, min(5.0, left))).close()
                self.store = dist.TCPStore(host, port, None, False,
                                           timedelta(seconds=max(1.0, min(5.0, left))))
                return
            except (OSError, RuntimeError, dist.DistStoreError) as e:
                now = time.monotonic()
                if now - start >= limit:
                    raise AFDTimeoutError(f"{what}: no AFD rendezvous at {host}:{port} after "
                                          f"{limit:.0f} s (connect_timeout_s; {e})") from None
                if now - last_log >= CONNECT_PROGRESS_EVERY_S:
                    logger.info("%s: waiting for the FFN role's rank 0 to host the AFD "
                                "rendezvous at %s:%d (%.0f s%s)", what, host, port, now - start,
                                "" if connect_timeout_s is None
                                else f" of connect_timeout_s {limit:.0f}")
                    last_log = now
                time.sleep(0.2)

    def wait_keys(self, keys: list[str], timeout_s: float | None, what: str) -> None:
        """Wait for keys with progress logs (None: no limit); AFDTimeoutError names the missing
        ones."""
        limit = math.inf if timeout_s is None else timeout_s
        start = time.monotonic()
        while True:
            missing = [k for k in keys if not self.store.check([k])]
            if not missing:
                return
            self.check_cancelled(what)
            waited = time.monotonic() - start
            if waited >= limit:
                raise AFDTimeoutError(f"{what}: still missing {missing} after {limit:.0f} s")
            try:
                self.store.wait(missing, timedelta(seconds=min(CONNECT_PROGRESS_EVERY_S,
                                                               max(0.1, limit - waited))))
            except (RuntimeError, dist.DistStoreError) as e:
                if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                    raise AFDPeerError(f"{what}: rendezvous store at {self.host}:{self.port} "
                                       f"failed: {e}") from None
                logger.info("%s: waiting for %s (%.0f s)", what, ", ".join(missing),
                            time.monotonic() - start)

    def check_cancelled(self, what: str) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise AFDPeerError(f"{what}: closed while waiting for the peers")

    def close(self) -> None:
        self.store = None  # type: ignore[assignment]


class SignedStore(dist.Store):
    """The rendezvous store as the process groups see it: every value carries an HMAC over its
    key and value under a key only the authenticated ranks hold, and a value without a valid
    one is refused. The store is reachable by anyone who reaches the port, and a group's
    backend learns each rank's address from it: after the handshake a host without the token
    could otherwise redirect a rank (or join in its place) by overwriting that entry.

    Only what the process-group backends use is forwarded (set, get, wait, check; add, whose
    counters name no address; the timeout). The owner keeps this object alive as long as any
    group made over it: the backend holds only the C++ side, whose Python methods go with it."""

    def __init__(self, inner: dist.Store, key: bytes):
        super().__init__()
        self._inner, self._key = inner, key

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, self._mac(key, value) + value)

    def get(self, key: str) -> bytes:
        data = bytes(self._inner.get(key))
        mac, value = data[:32], data[32:]
        if not hmac.compare_digest(mac, self._mac(key, value)):
            raise AFDPeerError(f"rendezvous entry {key!r} was not written by an authenticated "
                               "AFD rank (another process writes to the rendezvous store?); "
                               "refusing to connect to the address it names")
        return value

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def check(self, keys) -> bool:
        return self._inner.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self._inner.timeout


def new_group(backend: str, store: dist.Store, prefix: str, rank: int, size: int,
              timeout_s: float, host: str) -> dist.ProcessGroup:
    """A standalone process group (not registered as torch.distributed's default)."""
    pstore = dist.PrefixStore(prefix, store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = gloo_devices(host)
        return dist.ProcessGroupGloo(pstore, rank, size, opts)
    if backend == "loopback":  # every rank in this process (afd_common.transport.loopback)
        from afd_common.transport.loopback import join_group

        return join_group(pstore, rank, size)
    if backend == "nccl":  # pragma: no cover - needs CUDA; not exercised on the CPU machines
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(pstore, rank, size, opts)
    if backend == "hccl":  # pragma: no cover - needs torch-npu; not exercised here
        import torch_npu  # noqa: F401
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        opts = ProcessGroupHCCL.Options()
        opts._timeout = timeout
        return ProcessGroupHCCL(pstore, rank, size, opts)
    raise ValueError(f"unknown backend {backend!r}")


def gloo_devices(host: str) -> list:
    """The interfaces Gloo binds and advertises to its peers: those ``GLOO_SOCKET_IFNAME`` names
    (comma-separated, as torch.distributed reads it for its own groups), else the one that reaches
    the rendezvous host. Gloo's own default resolves this machine's hostname, which is often a
    loopback address (/etc/hosts): peers on other hosts would be told to connect to 127.0.0.1."""
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    if names:
        return [dist.ProcessGroupGloo.create_device(interface=n) for n in names]
    if is_loopback(host):
        return [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(host))]


def local_address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (connecting a UDP socket sends nothing)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((host, 9))
        return sock.getsockname()[0]


def default_backend(device: torch.device) -> str:
    return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")


def register_named_group(backend_pg, store: dist.Store, rank: int, size: int, name: str,
                         device: torch.device) -> dist.ProcessGroup:
    """Wrap a standalone backend (``new_group``) in a c10d ProcessGroup registered as ``name``.

    Compiled ops find their group by this name (``c10d::resolve_process_group``): the ``group_ep``
    / ``group_name`` string argument of the ``afd_ascend`` ops. Undo with ``unregister_group``.
    """
    c10d = torch._C._distributed_c10d
    kind = {"gloo": c10d.ProcessGroup.BackendType.GLOO,
            "nccl": c10d.ProcessGroup.BackendType.NCCL}.get(backend_name(backend_pg),
                                                          c10d.ProcessGroup.BackendType.CUSTOM)
    pg = c10d.ProcessGroup(store, rank, size)
    pg._set_default_backend(kind)
    pg._register_backend(device, kind, backend_pg)
    if device.type != "cpu" and kind == c10d.ProcessGroup.BackendType.GLOO:
        pg._register_backend(torch.device("cpu"), kind, backend_pg)
    pg._set_group_name(name)
    c10d._register_process_group(name, pg)
    return pg


def unregister_group(name: str) -> None:
    try:
        torch._C._distributed_c10d._unregister_process_group(name)
    except Exception:  # noqa: BLE001 - already gone
        pass
