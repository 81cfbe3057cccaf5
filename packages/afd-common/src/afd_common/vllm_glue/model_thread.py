"""What a thread of ours sets before it runs model code, on every platform.

Both roles run model code outside vLLM's own threads: the FFN role's serving loop and the
attention role's micro-batch threads. A new thread starts on CUDA device 0 (NPU device 0), and
on DP rank 1 of a node that is another rank's device, so kernels and NCCL work would land there;
vLLM's custom ops also consult the current vLLM config. One helper for both roles.
"""

from __future__ import annotations

import threading

import torch

_held = threading.local()  # the entered config context, alive as long as its thread


def enter_model_thread(vllm_config, device: torch.device | str) -> None:
    """Call first thing in a thread that will run model code. Not undone: the thread serves one
    model on one device for its whole life."""
    device = torch.device(device)
    if device.type == "cuda":  # pragma: no cover - no GPU on the project's machines
        torch.cuda.set_device(device)
    elif device.type == "npu":  # pragma: no cover - no NPU either
        torch.npu.set_device(device)
    if vllm_config is not None:
        from vllm.config import set_current_vllm_config

        # Entered and kept (a collected generator would restore the old config at once): the
        # config stays current for this thread's life. vLLM keeps it in a process global, and
        # setting the same config again is harmless.
        _held.config = set_current_vllm_config(vllm_config)
        _held.config.__enter__()
