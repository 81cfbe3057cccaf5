"""What the FFN role's workers change in vLLM's worker, on every platform.

The FFN role has no KV cache and runs no model forward of its own: warm-up, dummy batches and
``execute_model`` must not touch the model (its serving loop owns it).
"""

from __future__ import annotations

from afd_common.metrics import MetricsWorkerMixin

from afd_ffn.model_runner import AFDFFNRunnerMixin


class AFDFFNWorkerMixin(MetricsWorkerMixin):
    def compile_or_warm_up_model(self):
        from vllm.v1.worker.worker_base import CompilationTimes

        return CompilationTimes(language_model=0.0, encoder=0.0)

    def execute_model(self, *args, **kwargs):
        raise RuntimeError("the AFD FFN role runs no model steps of its own; send requests to "
                           "the attention role")

    def execute_dummy_batch(self) -> None:
        pass

    def shutdown(self):
        runner = getattr(self, "model_runner", None)
        if isinstance(runner, AFDFFNRunnerMixin) and runner.afd_service is not None:
            runner.afd_service.stop()
        super().shutdown()
