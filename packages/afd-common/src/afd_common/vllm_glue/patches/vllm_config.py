"""Hook into ``VllmConfig.__post_init__``: the one place every vLLM config is completed.

The API server (or ``LLM``) builds the config and the engine and worker processes receive it
already resolved, so choosing the worker here reaches every process. It also makes a bad ``afd``
section fail in the API server, before any engine process or socket exists.
"""

from __future__ import annotations

import logging
import os

from afd_common.vllm_glue import lifecycle, models
from afd_common.config import AFDConfig, afd_config_from_vllm
from afd_common.errors import AFDConfigError
from afd_common.vllm_glue.patching import PatchSet
from afd_common.registry import resolve_role
from afd_common.vllm_glue.model import ATTENTION_EP_KEY, expert_placement

logger = logging.getLogger("vllm.afd")

# Honest about Ascend: the AFD workers subclass a platform's vLLM worker, and no vllm-ascend
# release supports the vLLM this afd is built on. The ops and both CAM connectors are tested on CPU.
NO_NPU_WORKER = ("no AFD worker for Ascend NPUs yet: the AFD workers extend vllm-ascend's NPU "
                 "worker, and no vllm-ascend release supports vLLM 0.32 (the newest, 0.23.0.post1, "
                 "pins vLLM 0.23 with torch 2.10 / torch-npu 2.10). AFD on an NPU needs a "
                 "vllm-ascend built for vLLM 0.32 with torch 2.13 and torch-npu 2.13; until then "
                 "run the roles on CPU or CUDA (the afd_ascend ops and the CAM connectors run on "
                 "CPU with ops_backend \"portable\")")


def _device_kind() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return current_platform.device_type or "unknown"


def before(vllm_config, afd: AFDConfig) -> None:
    parallel = vllm_config.parallel_config
    role_ranks = afd.num_attention_ranks if afd.is_attention else afd.num_ffn_ranks
    field = "num_attention_ranks" if afd.is_attention else "num_ffn_ranks"
    # vLLM re-completes the config in each engine core. With async DP the attention engines are
    # independent DP ranks by then (DP size 1, not MoE for vLLM: afd_attention's async_dp_engine),
    # each with its own data_parallel_index.
    independent = (afd.async_dp and parallel.data_parallel_size == 1
                   and not vllm_config.model_config.is_moe)
    if parallel.data_parallel_size != role_ranks and not independent:
        raise AFDConfigError(field, role_ranks, f"the {afd.role} role runs one AFD rank per data-"
                             f"parallel rank, and --data-parallel-size is "
                             f"{parallel.data_parallel_size}; make them equal")
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise AFDConfigError(field, role_ranks, "AFD roles run with tensor and pipeline parallel "
                             "size 1 per rank in this version; scale with data parallelism")
    _check_placement(vllm_config, afd)
    models.check_model(vllm_config, afd)
    kind = _device_kind()
    if afd.async_dp:
        _check_async_dp(afd, kind)
    plugin = resolve_role(afd.role)
    if parallel.worker_cls == "auto":
        worker = plugin.workers.get(kind)
        if kind == "npu":
            raise AFDConfigError("role", afd.role, NO_NPU_WORKER)
        if worker is None:
            raise AFDConfigError("role", afd.role, f"no AFD worker for the {kind!r} platform in "
                                 "this version (CPU and CUDA are supported)")
        parallel.worker_cls = worker
    # Our runners extend vLLM's V1 model runner.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    lifecycle.install_root_failure_handler()
    lifecycle.exit_without_final_collection()
    plugin.on_vllm_config(vllm_config, afd)  # the role's own (e.g. async DP's engine patch)


def _check_placement(vllm_config, afd: AFDConfig) -> None:
    """Experts sharded over the FFN ranks (vLLM's ``--enable-expert-parallel``, given to both
    roles) are routed by the attention role, which must know each row's top-k to send it only to
    the ranks that own its experts."""
    if vllm_config.parallel_config.enable_eplb:
        raise AFDConfigError("enable_eplb", True, "AFD places the routed experts on the FFN ranks "
                             "itself (afd_common.placement); run without --enable-eplb")
    placement = expert_placement(vllm_config, afd.num_ffn_ranks)
    if afd.is_attention and vllm_config.parallel_config.enable_expert_parallel:
        # The attention role holds no routed experts, so vLLM's expert parallelism has nothing to
        # place there (and an async-DP attention engine is not MoE for vLLM, which then refuses
        # the flag). What the flag asks for is the placement the attention side routes by: keep
        # that, switch vLLM's off.
        vllm_config.additional_config[ATTENTION_EP_KEY] = True
        vllm_config.parallel_config.enable_expert_parallel = False
    if placement.sharded and not afd.compute_gate_on_attention:
        raise AFDConfigError("compute_gate_on_attention", False,
                             "with --enable-expert-parallel and num_ffn_ranks > 1 the routed "
                             "experts are sharded over the FFN ranks, and the attention role "
                             "routes each row to the ranks that own its top-k experts: set it "
                             "true on both roles (or drop --enable-expert-parallel to replicate "
                             "the experts on every FFN rank)")


def _check_async_dp(afd: AFDConfig, kind: str) -> None:
    """Async DP runs on the CAM ops: an NPU's, or their portable kernels on CPU when asked for."""
    if kind == "cpu":
        if afd.extra.ops_backend != "portable":
            raise AFDConfigError("connector_extra_config.ops_backend", afd.extra.ops_backend,
                                 "async_dp on CPU runs the afd_ascend ops' portable kernels: set "
                                 "it to \"portable\"")
    elif kind != "npu":
        raise AFDConfigError("async_dp", afd.async_dp, f"async DP needs the CAM ops of an Ascend "
                             f"NPU (or their portable kernels on CPU); not available on {kind!r}")


def after(vllm_config, afd: AFDConfig) -> None:
    if afd.is_ffn:
        # No attention layers -> no cacheable KV groups; the hybrid coordinator would assert.
        vllm_config.cache_config.enable_prefix_caching = False
    cuda_graph_policy(vllm_config.compilation_config, afd)


REMOTE_EXPERTS_OP = "afd::remote_experts"


def cuda_graph_policy(compilation, afd: AFDConfig) -> None:
    """Where CUDA graphs are safe in AFD, decided once vLLM has resolved its own modes.

    Attention role: a captured graph replays kernels, not Python. The remote call
    (``afd::remote_experts``) sends and receives through the connector, which keeps a step frame
    and per-call bookkeeping (and whose peer runs its own schedule), so it must stay outside every
    graph: it becomes a splitting op, and piecewise graphs are captured around it. Full graphs
    (FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE) would capture it, so they are downgraded to
    PIECEWISE (with compilation) or NONE (without), with one log line saying why.

    FFN role: its experts run per work item outside any vLLM forward, on batch sizes the
    attention side chooses; it runs eager (no compilation, no graphs).
    """
    from vllm.config import CUDAGraphMode
    from vllm.config.compilation import CompilationMode

    mode = compilation.cudagraph_mode
    if afd.is_ffn:
        if mode != CUDAGraphMode.NONE or compilation.mode != CompilationMode.NONE:
            logger.info("AFD FFN role: runs its experts eagerly per work item; CUDA graphs and "
                        "compilation off (was cudagraph_mode=%s)", mode.name)
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        compilation.mode = CompilationMode.NONE
        return
    if mode == CUDAGraphMode.NONE:
        return
    piecewise = compilation.mode == CompilationMode.VLLM_COMPILE
    if piecewise:
        ops = list(compilation.splitting_ops or [])
        if REMOTE_EXPERTS_OP not in ops:
            compilation.splitting_ops = ops + [REMOTE_EXPERTS_OP]
    if mode.has_full_cudagraphs():
        downgrade = CUDAGraphMode.PIECEWISE if piecewise else CUDAGraphMode.NONE
        logger.warning("AFD attention role: cudagraph_mode %s would capture the remote expert "
                       "call (a send and receive through the connector) inside a CUDA graph; "
                       "using %s, with graphs split around %s", mode.name, downgrade.name,
                       REMOTE_EXPERTS_OP)
        compilation.cudagraph_mode = downgrade


def build() -> PatchSet:
    from vllm.config.vllm import VllmConfig

    original = VllmConfig.__post_init__

    def __post_init__(self, *args, **kwargs):
        afd = afd_config_from_vllm(self)
        if afd is not None:
            before(self, afd)
        original(self, *args, **kwargs)
        if afd is not None:
            after(self, afd)

    return PatchSet("vllm_config").setattr(VllmConfig, "__post_init__", __post_init__)
