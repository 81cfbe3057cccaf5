"""Config parsing: every malformed config raises one AFDConfigError naming the field."""

import pytest

from afd_common.config import AUTH_TOKEN_ENV, parse_afd_config
from afd_common.errors import AFDConfigError

GOOD = {"role": "ffn", "connector": "P2pAFDConnector", "host": "127.0.0.1", "port": 29600,
        "num_attention_ranks": 2, "num_ffn_ranks": 1}


def with_(**kw):
    cfg = {**GOOD, **kw}
    return {k: v for k, v in cfg.items() if v is not DROP}


DROP = object()

MALFORMED = [
    ("role", with_(role="experts")),
    ("role", with_(role=None)),
    ("role", with_(role=DROP)),
    ("role", with_(role="")),
    ("connector", with_(connector="NoSuchConnector")),
    ("connector", with_(connector="")),
    ("connector", with_(connector=3)),
    ("host", with_(host="")),
    ("host", with_(host="   ")),
    ("host", with_(host=["127.0.0.1"])),
    ("host", with_(host="127.0.0.1 evil")),
    ("port", with_(port=0)),
    ("port", with_(port=65536)),
    ("port", with_(port=-1)),
    ("port", with_(port="29600")),
    ("port", with_(port=29600.0)),
    ("port", with_(port=True)),
    ("num_attention_ranks", with_(num_attention_ranks=0)),
    ("num_attention_ranks", with_(num_attention_ranks=-2)),
    ("num_attention_ranks", with_(num_attention_ranks="2")),
    ("num_ffn_ranks", with_(num_ffn_ranks=0)),
    ("num_ffn_ranks", with_(num_ffn_ranks=1.5)),
    ("compute_gate_on_attention", with_(compute_gate_on_attention="yes")),
    ("compute_gate_on_attention", with_(compute_gate_on_attention=1)),
    ("async_dp", with_(async_dp="true")),
    ("async_dp", with_(async_dp=True)),  # P2P does not support async DP
    ("async", with_(**{"async": True, "async_dp": True})),
    ("afd_role", with_(afd_role="ffn")),  # alias given with its canonical key
    ("afd_port", with_(afd_port=1234)),
    ("afd_host", with_(afd_host="localhost")),
    ("afd_connector", with_(afd_connector="P2pAFDConnector")),
    ("bogus_key", with_(bogus_key=1)),
    ("connector_extra_config", with_(connector_extra_config=[1, 2])),
    ("connector_extra_config.backend", with_(connector_extra_config={"backend": "mpi"})),
    ("connector_extra_config.timeout_s", with_(connector_extra_config={"timeout_s": 0})),
    ("connector_extra_config.timeout_s", with_(connector_extra_config={"timeout_s": "10"})),
    ("connector_extra_config.timeout_s",
     with_(connector_extra_config={"timeout_s": float("inf")})),
    ("connector_extra_config.connect_timeout_s",
     with_(connector_extra_config={"connect_timeout_s": -1})),
    ("connector_extra_config.reconnect_timeout_s",
     with_(connector_extra_config={"reconnect_timeout_s": -0.5})),
    ("connector_extra_config.reconnect_timeout_s",
     with_(connector_extra_config={"reconnect_timeout_s": True})),
    ("connector_extra_config.num_micro_batches",
     with_(connector_extra_config={"num_micro_batches": 0})),
    ("connector_extra_config.auth_token", with_(connector_extra_config={"auth_token": ""})),
    ("connector_extra_config.nonsense", with_(connector_extra_config={"nonsense": 1})),
    ("connector_extra_config.ops_backend",
     with_(connector_extra_config={"ops_backend": "magic"})),
]


@pytest.mark.parametrize("field,raw", MALFORMED, ids=[f"{i}-{f}" for i, (f, _) in
                                                     enumerate(MALFORMED)])
def test_malformed_config_names_the_field(field, raw):
    with pytest.raises(AFDConfigError) as info:
        parse_afd_config(raw)
    assert isinstance(info.value, ValueError)
    assert f"'{field}'" in str(info.value), str(info.value)
    assert info.value.field == field


def test_not_a_mapping():
    with pytest.raises(AFDConfigError, match="'afd'"):
        parse_afd_config(["role", "ffn"])


def test_defaults_and_aliases():
    cfg = parse_afd_config({"afd_role": "attention", "afd_port": 1234, "afd_host": "localhost",
                            "afd_connector": "P2pNcclAFDConnector", "async": False})
    assert (cfg.role, cfg.port, cfg.host, cfg.connector) == ("attention", 1234, "localhost",
                                                             "P2pNcclAFDConnector")
    assert cfg.num_attention_ranks == cfg.num_ffn_ranks == 1
    assert cfg.extra.num_micro_batches == 1 and cfg.extra.backend is None


def test_timeout_sets_both_bounds():
    cfg = parse_afd_config(with_(connector_extra_config={"timeout_s": 10}))
    assert cfg.extra.first_step_timeout_s == 10 and cfg.extra.step_timeout_s == 10
    cfg = parse_afd_config(GOOD)
    assert cfg.extra.first_step_timeout_s == 300 and cfg.extra.step_timeout_s == 60


def test_waiting_for_the_peer_is_unbounded_unless_connect_timeout_s_is_set():
    assert parse_afd_config(GOOD).extra.connect_timeout_s is None
    cfg = parse_afd_config(with_(connector_extra_config={"timeout_s": 10}))
    assert cfg.extra.connect_timeout_s is None  # the step knob does not bound the start-up
    cfg = parse_afd_config(with_(connector_extra_config={"connect_timeout_s": 90}))
    assert cfg.extra.connect_timeout_s == 90


def test_the_attention_role_waits_120_s_for_a_lost_ffn_role_unless_told_otherwise():
    assert parse_afd_config(GOOD).extra.reconnect_timeout_s == 120
    cfg = parse_afd_config(with_(connector_extra_config={"reconnect_timeout_s": 0}))
    assert cfg.extra.reconnect_timeout_s == 0  # today's fail-fast


def test_auth_token_from_env_is_not_in_repr(monkeypatch):
    monkeypatch.setenv(AUTH_TOKEN_ENV, "s3cret-token")
    cfg = parse_afd_config(GOOD)
    assert cfg.extra.auth_token == "s3cret-token"
    assert "s3cret" not in repr(cfg)


def test_error_for_secret_never_echoes_it():
    with pytest.raises(AFDConfigError) as info:
        parse_afd_config(with_(connector_extra_config={"auth_token": 12345}))
    assert "12345" not in str(info.value)


def test_unknown_connector_lists_installed():
    with pytest.raises(AFDConfigError, match="installed: .*P2pAFDConnector"):
        parse_afd_config(with_(connector="Nope"))


# Fuzz: every input either parses or raises the project's own error type, never anything else.
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from afd_common.config import ALIASES, AFDConfig, KEYS  # noqa: E402

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=True), st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6)
key_names = st.one_of(st.sampled_from(KEYS + tuple(ALIASES)), st.text(max_size=10))
extra_keys = st.sampled_from(["backend", "timeout_s", "connect_timeout_s", "first_step_timeout_s",
                              "step_timeout_s", "reconnect_timeout_s",
                              "num_micro_batches", "auth_token", "ops_backend", "x"])
plausible = st.fixed_dictionaries(
    {"role": st.sampled_from(["attention", "ffn", "FFN", "", 1])},
    optional={"port": st.one_of(st.integers(-5, 70000), json_scalars),
              "host": st.one_of(st.sampled_from(["127.0.0.1", "", " ", "h o"]), json_scalars),
              "num_attention_ranks": st.one_of(st.integers(-2, 5), json_scalars),
              "num_ffn_ranks": st.one_of(st.integers(-2, 5), json_scalars),
              "compute_gate_on_attention": json_scalars,
              "async_dp": json_scalars, "async": json_scalars,
              "connector": st.sampled_from(["P2pAFDConnector", "P2pNcclAFDConnector", "Nope"]),
              "connector_extra_config": st.one_of(
                  json_values, st.dictionaries(extra_keys, json_values, max_size=3))})


@settings(max_examples=2000, deadline=None)
@given(st.one_of(plausible, st.dictionaries(key_names, json_values, max_size=6), json_values))
def test_config_parser_fuzz(raw):
    try:
        cfg = parse_afd_config(raw)
    except AFDConfigError as e:
        assert isinstance(e.field, str) and str(e).startswith("afd config: field ")
        return
    assert isinstance(cfg, AFDConfig) and cfg.role in ("attention", "ffn")
    assert 1 <= cfg.port <= 65535 and cfg.host.strip()
