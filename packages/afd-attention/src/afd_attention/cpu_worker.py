"""The attention role's worker on CPU (chosen by the afd plugin when ``worker_cls`` is auto)."""

from __future__ import annotations

import vllm.v1.worker.cpu_worker as cpu_worker_module
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from afd_common.metrics import MetricsWorkerMixin
from afd_common.vllm_glue.patching import PatchSet

from afd_attention.model_runner import AFDAttentionRunnerMixin, AFDAttentionWorkerMixin


class AFDAttentionCPUModelRunner(AFDAttentionRunnerMixin, CPUModelRunner):
    pass


class AFDAttentionCPUWorker(AFDAttentionWorkerMixin, MetricsWorkerMixin, CPUWorker):
    def init_device(self):
        # CPUWorker builds its runner by module-global name; swap it for the call only.
        with PatchSet("attention_cpu_runner").setattr(cpu_worker_module, "CPUModelRunner",
                                               AFDAttentionCPUModelRunner).applied():
            super().init_device()
