"""The FFN role's worker on CUDA (chosen by the afd plugin when ``worker_cls`` is auto).

Written to the same contract as the CPU worker; not exercised on the CPU-only machines this
project is tested on.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from afd_ffn.model_runner import AFDFFNRunnerMixin
from afd_ffn.worker import AFDFFNWorkerMixin


class AFDFFNGPUModelRunner(AFDFFNRunnerMixin, GPUModelRunner):
    pass


class AFDFFNGPUWorker(AFDFFNWorkerMixin, Worker):
    def _make_model_runner(self):
        return AFDFFNGPUModelRunner(self.vllm_config, self.device)
