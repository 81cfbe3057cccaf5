from importlib.metadata import EntryPoint

import pytest

import afd_common.registry as registry
from afd_common.errors import AFDConfigError


def test_builtin_halves_and_alias_resolve_to_the_same_classes():
    installed = registry.installed_connectors()
    for name in ("P2pAFDConnector", "P2pNcclAFDConnector"):
        assert set(installed[name]) == {"attention", "ffn"}
    for role in ("attention", "ffn"):
        cls = registry.resolve_connector("P2pAFDConnector", role)
        assert cls is registry.resolve_connector("P2pNcclAFDConnector", role)
        assert cls.role == role


def test_unknown_name_lists_installed():
    with pytest.raises(AFDConfigError) as info:
        registry.resolve_connector("Missing", "ffn")
    assert "P2pAFDConnector" in str(info.value) and info.value.field == "connector"


def test_missing_half_says_which_package_to_install(monkeypatch):
    only_attention = [EntryPoint("attention:P2pAFDConnector",
                                 "afd_attention.p2p_connector:P2pAttentionConnector",
                                 registry.GROUP)]
    monkeypatch.setattr(registry, "entry_points", lambda group: only_attention)
    with pytest.raises(AFDConfigError, match="install afd-ffn"):
        registry.resolve_connector("P2pAFDConnector", "ffn")


def test_third_party_connector_is_found_without_touching_us(monkeypatch):
    eps = [EntryPoint("ffn:AcmeConnector", "collections:OrderedDict", registry.GROUP),
           EntryPoint("not-a-role-name", "collections:OrderedDict", registry.GROUP)]
    monkeypatch.setattr(registry, "entry_points", lambda group: eps)
    import collections
    assert registry.resolve_connector("AcmeConnector", "ffn") is collections.OrderedDict
    with pytest.raises(AFDConfigError, match="attention half is not installed"):
        registry.resolve_connector("AcmeConnector", "attention")
