"""Every afd patch set installs over vLLM and uninstalls back to vLLM's own symbols."""

import importlib

import pytest

from afd_common.patching import PatchSet


def builders():
    importlib.import_module("vllm.entrypoints.launchers.app")  # as in the API server process
    from afd_attention.patches import remote_moe
    from afd_common.patches import api_server, vllm_config
    from afd_ffn.patches import prune
    return {"vllm_config": vllm_config.build, "api_server": api_server.build,
            "attention_remote_moe": remote_moe.build, "ffn_prune": prune.build}


def snapshot(patch: PatchSet):
    attrs = {(id(t), a): t.__dict__.get(a, "<missing>") if isinstance(t, type)
             else getattr(t, a, "<missing>") for t, a, _ in patch._attrs}
    items = {(id(m), k): m.get(k, "<missing>") for m, k, _ in patch._items}
    return attrs, items


@pytest.mark.parametrize("name", ["vllm_config", "api_server", "attention_remote_moe",
                                  "ffn_prune"])
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
