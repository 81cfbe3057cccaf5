"""The FFN role's worker on CPU (chosen by the afd plugin when ``worker_cls`` is auto)."""

from __future__ import annotations

import vllm.v1.worker.cpu_worker as cpu_worker_module
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from afd_common.vllm_glue.patching import PatchSet

from afd_ffn.model_runner import AFDFFNRunnerMixin
from afd_ffn.worker import AFDFFNWorkerMixin


class AFDFFNCPUModelRunner(AFDFFNRunnerMixin, CPUModelRunner):
    pass


class AFDFFNCPUWorker(AFDFFNWorkerMixin, CPUWorker):
    def init_device(self):
        # CPUWorker builds its runner by module-global name; swap it for the call only.
        with PatchSet("ffn_cpu_runner").setattr(cpu_worker_module, "CPUModelRunner",
                                               AFDFFNCPUModelRunner).applied():
            super().init_device()
