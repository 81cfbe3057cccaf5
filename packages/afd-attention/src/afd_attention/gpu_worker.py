"""The attention role's worker on CUDA (chosen by the afd plugin when ``worker_cls`` is auto).

Written to the same contract as the CPU worker; not exercised on the CPU-only machines this
project is tested on.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from afd_common.metrics import MetricsWorkerMixin

from afd_attention.model_runner import AFDAttentionRunnerMixin, AFDAttentionWorkerMixin


class AFDAttentionGPUModelRunner(AFDAttentionRunnerMixin, GPUModelRunner):
    pass


class AFDAttentionGPUWorker(AFDAttentionWorkerMixin, MetricsWorkerMixin, Worker):
    def _make_model_runner(self):
        return AFDAttentionGPUModelRunner(self.vllm_config, self.device)
