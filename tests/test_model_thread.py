"""Threads that run model code set the device and vLLM's current config first (one helper for
both roles): checked on a CUDA-like device without a GPU."""

import threading

import torch

from afd_attention.micro_batches import MicroBatchPipeline
from afd_common.vllm_glue.model_thread import enter_model_thread


def test_sets_device_and_vllm_config_in_the_thread(monkeypatch):
    import vllm.config.vllm as vllm_config_module
    from vllm.config import get_current_vllm_config

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(
        (threading.current_thread().name, torch.device(d))))
    sentinel = object()
    old = vllm_config_module._current_vllm_config
    seen = {}

    def run():
        enter_model_thread(sentinel, "cuda:1")
        seen["config"] = get_current_vllm_config()

    try:
        t = threading.Thread(target=run, name="afd-test-model-thread")
        t.start()
        t.join(10)
    finally:
        vllm_config_module._current_vllm_config = old
    assert calls == [("afd-test-model-thread", torch.device("cuda:1"))]
    assert seen["config"] is sentinel


def test_cpu_needs_no_device_call(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: (_ for _ in ()).throw(
        AssertionError("no CUDA call on CPU")))
    enter_model_thread(None, "cpu")


def test_micro_batch_threads_run_the_setup_once_each():
    names = []
    lock = threading.Lock()

    def setup():
        with lock:
            names.append(threading.current_thread().name)

    pipeline = MicroBatchPipeline(3, thread_setup=setup)
    assert pipeline.run([lambda: 0, lambda: 1, lambda: 2], lambda s: None) == [0, 1, 2]
    assert pipeline.run([lambda: 3, lambda: 4], lambda s: None) == [3, 4]
    assert sorted(names) == ["afd-micro-batch-1", "afd-micro-batch-2"]
