"""Every afd patch set installs over vLLM and uninstalls back to vLLM's own symbols."""

import re
from pathlib import Path

import pytest

from afd_common.vllm_glue.patching import PatchSet
from patch_symbols import builders, symbols


def snapshot(patch: PatchSet):
    attrs = {(id(t), a): t.__dict__.get(a, "<missing>") if isinstance(t, type)
             else getattr(t, a, "<missing>") for t, a, _ in patch._attrs}
    items = {(id(m), k): m.get(k, "<missing>") for m, k, _ in patch._items}
    return attrs, items


@pytest.mark.parametrize("name", ["vllm_config", "api_server", "moe_parallel", "weight_census",
                                  "attention_remote_moe",
                                  "ffn_prune", "async_dp_engine", "async_dp_forward_context"])
def test_install_then_uninstall_restores_vllm(name):
    patch = builders()[name]()
    assert patch is not None and (patch._attrs or patch._items)
    before = snapshot(patch)
    if patch.installed:  # the plugin may have installed it in this process already
        patch.uninstall()
    with patch.applied():
        during = snapshot(patch)
        assert all(during[0][k] is not v for k, v in before[0].items()) or not before[0]
        patch.install()  # idempotent
    after = snapshot(patch)
    assert all(after[0][k] is v for k, v in before[0].items())
    assert all(after[1][k] is v for k, v in before[1].items())


def test_version_guard(monkeypatch):
    import vllm
    monkeypatch.setattr(vllm, "__version__", "0.31.4")
    patch = builders()["ffn_prune"]()
    with pytest.raises(RuntimeError, match="written for vLLM 0.32"):
        patch.install()
    assert not patch.installed


def test_async_dp_patches_see_vllm_as_it_is_meant():
    """While installed: the attention model is not MoE for vLLM's engine and DP decisions, and
    spawned engine cores start through the wrapper that installs the same patch set."""
    from vllm.config.model import ModelConfig
    from vllm.v1.engine.core import EngineCoreProc
    import vllm.forward_context as fc
    import vllm.v1.worker.gpu_model_runner as gmr

    from afd_attention.patches import async_dp_engine, async_dp_forward_context

    engine = async_dp_engine.build()
    with engine.applied():
        assert ModelConfig.is_moe.fget(object()) is False
        assert EngineCoreProc.run_engine_core is async_dp_engine.run_engine_core
    assert EngineCoreProc.run_engine_core is async_dp_engine._VLLM_RUN_ENGINE_CORE
    original = fc.set_forward_context
    ctx = async_dp_forward_context.build()
    with ctx.applied():
        assert fc.set_forward_context is gmr.set_forward_context is not original
    assert fc.set_forward_context is gmr.set_forward_context is original


@pytest.mark.parametrize("kind,extra,field", [
    ("cpu", {}, "ops_backend"), ("cuda", {"ops_backend": "portable"}, "async_dp"),
    ("cpu", {"ops_backend": "portable"}, None), ("npu", {}, None)])
def test_async_dp_platform_gate(kind, extra, field):
    from afd_common.config import parse_afd_config
    from afd_common.errors import AFDConfigError
    from afd_common.vllm_glue.patches.vllm_config import _check_async_dp

    afd = parse_afd_config({"role": "attention", "connector": "CAMAsyncAFDConnector",
                            "async_dp": True, "compute_gate_on_attention": True,
                            "connector_extra_config": extra})
    if field is None:
        _check_async_dp(afd, kind)
    else:
        with pytest.raises(AFDConfigError, match=field):
            _check_async_dp(afd, kind)


def test_the_readme_lists_every_patched_vllm_symbol_and_nothing_else():
    """README "What afd changes in vLLM" is the written list: one place to read what afd
    replaces in vLLM, kept true here."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## What afd changes in vLLM", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(vllm\.[\w.]+(?:\['\w+'\])?)`", section))
    patched = set().union(*(symbols(build()) for build in builders().values()))
    assert listed == patched, (f"patched, not listed: {sorted(patched - listed)}; "
                               f"listed, not patched: {sorted(listed - patched)}")
