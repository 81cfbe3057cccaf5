"""The ``afd_ascend`` op library and its loaders.

``_C.so`` (compiled by this package's build hook against the installed torch) defines the op
schemas NPU deployments call, Meta kernels for tracing, and portable kernels over c10d
point-to-point registered for CPU (Gloo) and PrivateUse1 (HCCL through torch-npu). The kernels
find their process group by the name passed as ``group_ep`` / ``group_name``. Semantics of each op:
``csrc/cam_p2p.cpp`` (a2e, e2a) and ``csrc/cam_async.cpp`` (the four ``afd_async_*`` ops).

Connectors call ``ensure_cam_p2p_ops_available()`` or ``ensure_cam_async_ops_available()`` before
forming any group: each loads the library once and checks that every op it needs exists *and* has
a kernel for the device in use, raising one ``RuntimeError`` that names what is missing, the
backend and the remedy. Success is cached per (ops, device); failure is not, so a fix (e.g.
importing torch_npu) can be retried in the same process.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

__all__ = ["CAM_ASYNC_OPS", "CAM_P2P_OPS", "ensure_afd_ascend_ops_loaded",
           "ensure_cam_async_ops_available", "ensure_cam_p2p_ops_available", "library_path"]

NAMESPACE = "afd_ascend"
CAM_P2P_OPS = ("a2e", "e2a")
CAM_ASYNC_OPS = CAM_P2P_OPS + ("afd_async_dispatch_send", "afd_async_dispatch_recv",
                               "afd_async_combine_send", "afd_async_combine_recv")
# torch device type -> the dispatch key its kernels are registered under.
_DISPATCH_KEYS = {"cpu": "CPU", "npu": "PrivateUse1", "cuda": "CUDA", "meta": "Meta"}
_REMEDY = ("reinstall afd-ascend-ops so its build hook compiles the library against this torch "
           "(`uv sync --reinstall-package afd-ascend-ops`, or `pip install --force-reinstall "
           "--no-deps afd-ascend-ops`)")

_lock = threading.Lock()
_loaded = False
_available: set[tuple[tuple[str, ...], str]] = set()


def library_path() -> Path:
    return Path(__file__).with_name("_C.so")


def _load() -> None:
    global _loaded
    if _loaded:
        return
    path = library_path()
    if not path.exists():
        raise RuntimeError(f"the afd_ascend op library is not built: {path} is missing; {_REMEDY}")
    try:
        torch.ops.load_library(str(path))
    except OSError as e:
        raise RuntimeError(f"cannot load the afd_ascend op library {path}: {e}; {_REMEDY}") from None
    _loaded = True


def default_device() -> torch.device:
    npu = getattr(torch, "npu", None)  # present once torch_npu is imported
    if npu is not None and npu.is_available():
        return torch.device("npu")
    return torch.device("cpu")


def _ensure(ops: tuple[str, ...], device: torch.device | str | None) -> None:
    device = torch.device(device) if device is not None else default_device()
    key = (ops, device.type)
    if key in _available:
        return
    with _lock:
        _load()
        dispatch_key = _DISPATCH_KEYS.get(device.type)
        missing = [op for op in ops if not torch._C._dispatch_has_kernel(f"{NAMESPACE}::{op}")]
        no_kernel = [op for op in ops if op not in missing and (
            dispatch_key is None or not torch._C._dispatch_has_kernel_for_dispatch_key(
                f"{NAMESPACE}::{op}", dispatch_key))]
        if missing or no_kernel:
            parts = []
            if missing:
                parts.append(f"not defined: {', '.join(missing)}")
            if no_kernel:
                parts.append(f"no kernel for device '{device.type}' "
                             f"(dispatch key {dispatch_key or 'unknown'}): {', '.join(no_kernel)}")
            hint = _REMEDY if missing else (
                "the portable kernels cover CPU (Gloo) and NPU (PrivateUse1 via torch-npu; "
                "import torch_npu first); on CUDA use P2pAFDConnector")
            raise RuntimeError(f"afd_ascend ops unavailable on backend '{device.type}': "
                               f"{'; '.join(parts)}. Remedy: {hint}")
        _available.add(key)


def ensure_cam_p2p_ops_available(device: torch.device | str | None = None) -> None:
    """The ops of ``CAMP2pAFDConnector`` (a2e, e2a) on ``device`` (default: NPU if present)."""
    _ensure(CAM_P2P_OPS, device)


def ensure_cam_async_ops_available(device: torch.device | str | None = None) -> None:
    """The ops of ``CAMAsyncAFDConnector``: a2e, e2a and the four ``afd_async_*``."""
    _ensure(CAM_ASYNC_OPS, device)


ensure_afd_ascend_ops_loaded = ensure_cam_async_ops_available
