"""The CUDA-graph decision, on a CUDA-like compilation config (no GPU needed): the attention
role keeps piecewise graphs split around the remote call and never captures it in a full graph;
the FFN role runs eager."""

from types import SimpleNamespace

import pytest
from vllm.config import CUDAGraphMode
from vllm.config.compilation import CompilationMode

from afd_common.config import parse_afd_config
from afd_common.vllm_glue.patches.vllm_config import REMOTE_EXPERTS_OP, cuda_graph_policy

ATTENTION = parse_afd_config({"role": "attention"})
FFN = parse_afd_config({"role": "ffn"})


def compilation(mode, cudagraph_mode, splitting_ops=None):
    return SimpleNamespace(mode=mode, cudagraph_mode=cudagraph_mode,
                           splitting_ops=splitting_ops if splitting_ops is not None
                           else ["vllm::unified_attention"])


@pytest.mark.parametrize("graphs", [CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL,
                                    CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.PIECEWISE])
def test_attention_keeps_piecewise_graphs_split_around_the_remote_call(graphs, caplog):
    c = compilation(CompilationMode.VLLM_COMPILE, graphs)
    cuda_graph_policy(c, ATTENTION)
    assert c.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert c.splitting_ops == ["vllm::unified_attention", REMOTE_EXPERTS_OP]
    downgraded = [r for r in caplog.records if "would capture the remote expert call" in r.message]
    assert len(downgraded) == (0 if graphs == CUDAGraphMode.PIECEWISE else 1)
    cuda_graph_policy(c, ATTENTION)  # idempotent: vLLM may complete a config twice
    assert c.splitting_ops.count(REMOTE_EXPERTS_OP) == 1


def test_attention_without_compilation_runs_full_graphs_never():
    c = compilation(CompilationMode.NONE, CUDAGraphMode.FULL)
    cuda_graph_policy(c, ATTENTION)
    assert c.cudagraph_mode == CUDAGraphMode.NONE


def test_cpu_and_eager_configs_are_untouched():
    c = compilation(CompilationMode.NONE, CUDAGraphMode.NONE, [])
    cuda_graph_policy(c, ATTENTION)
    assert (c.mode, c.cudagraph_mode, c.splitting_ops) == (CompilationMode.NONE,
                                                            CUDAGraphMode.NONE, [])


def test_ffn_runs_eager():
    c = compilation(CompilationMode.VLLM_COMPILE, CUDAGraphMode.FULL_AND_PIECEWISE)
    cuda_graph_policy(c, FFN)
    assert c.cudagraph_mode == CUDAGraphMode.NONE and c.mode == CompilationMode.NONE
