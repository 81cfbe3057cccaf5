"""The ``afd`` section of vLLM's ``--additional-config``, parsed and validated.

Users of upstream afd-plugin already write these keys, so we accept them (and upstream's aliases)
unchanged. Everything is checked here, before any socket or process group exists, so a typo costs
one clear ``AFDConfigError`` (a ``ValueError``) naming the field and the value, not a hang.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from afd_common.errors import AFDConfigError
from afd_common import registry
from afd_common.registry import ROLES

Role = Literal["attention", "ffn"]

# Upstream afd-plugin spellings -> ours.
ALIASES: dict[str, str] = {
    "afd_role": "role",
    "afd_connector": "connector",
    "afd_host": "host",
    "afd_port": "port",
    "async": "async_dp",
}

DEFAULT_CONNECTOR = "P2pAFDConnector"
DEFAULT_PORT = 29600
DEFAULT_FIRST_STEP_TIMEOUT_S = 300.0
DEFAULT_STEP_TIMEOUT_S = 60.0
DEFAULT_RECONNECT_TIMEOUT_S = 120.0
AUTH_TOKEN_ENV = "AFD_AUTH_TOKEN"


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise AFDConfigError(name, value, "must be a JSON boolean (true/false)")
    return value


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise AFDConfigError(name, value, "must be an integer")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise AFDConfigError(name, value, f"must be {bound}")
    return value


def _check_positive_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AFDConfigError(name, value, "must be a number of seconds")
    if not math.isfinite(value) or value <= 0:
        raise AFDConfigError(name, value, "must be a finite number of seconds > 0")
    return float(value)


def _check_seconds(name: str, value: Any) -> float:
    """A finite number of seconds >= 0 (0 switches the wait off)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AFDConfigError(name, value, "must be a number of seconds")
    if not math.isfinite(value) or value < 0:
        raise AFDConfigError(name, value, "must be a finite number of seconds >= 0")
    return float(value)


def _check_str(name: str, value: Any, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str):
        raise AFDConfigError(name, value, "must be a string")
    if not value.strip():
        raise AFDConfigError(name, value, "must not be empty")
    if choices is not None and value not in choices:
        raise AFDConfigError(name, value, f"must be one of {', '.join(choices)}")
    return value


@dataclass(frozen=True)
class ExtraConfig:
    """``connector_extra_config``: transport knobs shared by every connector.

    Connector-specific keys are declared by the connector class (``extra_config_keys``) and kept
    in ``other`` untouched.
    """

    backend: str | None = None  # None = from the device: gloo on CPU, nccl on CUDA, hccl on NPU
    # How long a role waits for its peers to turn up (rendezvous and handshake). None: as long as
    # it takes (a checkpoint may load for an hour), with progress in the log.
    connect_timeout_s: float | None = None
    first_step_timeout_s: float = DEFAULT_FIRST_STEP_TIMEOUT_S
    # How long the attention role waits for an FFN role to come back after losing it, its
    # server up and its requests kept; 0: fail at once (in-flight requests get errors).
    reconnect_timeout_s: float = DEFAULT_RECONNECT_TIMEOUT_S
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    num_micro_batches: int = 1
    auth_token: str | None = field(default=None, repr=False)
    ops_backend: str | None = None  # "portable" runs the afd_ascend ops on CPU
    other: Mapping[str, Any] = field(default_factory=dict)


BACKENDS = ("gloo", "nccl", "hccl")
OPS_BACKENDS = ("portable", "ascend")


def parse_extra_config(raw: Any, connector_keys: frozenset[str] = frozenset()) -> ExtraConfig:
    name = "connector_extra_config"
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise AFDConfigError(name, raw, "must be a JSON object")
    kwargs: dict[str, Any] = {}
    other: dict[str, Any] = {}
    for key, value in raw.items():
        fname = f"{name}.{key}"
        if key == "backend":
            kwargs["backend"] = _check_str(fname, value, BACKENDS)
        elif key == "timeout_s":
            # One knob for users: the first step (which may compile) and every later step.
            kwargs["first_step_timeout_s"] = _check_positive_seconds(fname, value)
            kwargs.setdefault("step_timeout_s", min(kwargs["first_step_timeout_s"],
                                                    DEFAULT_STEP_TIMEOUT_S))
        elif key == "connect_timeout_s":
            kwargs["connect_timeout_s"] = _check_positive_seconds(fname, value)
        elif key == "first_step_timeout_s":
            kwargs["first_step_timeout_s"] = _check_positive_seconds(fname, value)
        elif key == "reconnect_timeout_s":
            kwargs["reconnect_timeout_s"] = _check_seconds(fname, value)
        elif key == "step_timeout_s":
            kwargs["step_timeout_s"] = _check_positive_seconds(fname, value)
        elif key == "num_micro_batches":
            kwargs["num_micro_batches"] = _check_int(fname, value, 1, 64)
        elif key == "auth_token":
            if not isinstance(value, str) or not value:
                # Never echo a secret back, even a malformed one.
                raise AFDConfigError(fname, "<redacted>", "must be a non-empty string")
            kwargs["auth_token"] = value
        elif key == "ops_backend":
            kwargs["ops_backend"] = _check_str(fname, value, OPS_BACKENDS)
        elif key in connector_keys:
            other[key] = value
        else:
            known = sorted({"backend", "timeout_s", "connect_timeout_s", "first_step_timeout_s",
                            "reconnect_timeout_s", "step_timeout_s", "num_micro_batches",
                            "auth_token", "ops_backend"}
                           | connector_keys)
            raise AFDConfigError(fname, value, f"unknown key; known keys: {', '.join(known)}")
    if "auth_token" not in kwargs and os.environ.get(AUTH_TOKEN_ENV):
        kwargs["auth_token"] = os.environ[AUTH_TOKEN_ENV]
    return ExtraConfig(other=other, **kwargs)


@dataclass(frozen=True)
class AFDConfig:
    role: Role
    connector: str = DEFAULT_CONNECTOR
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    compute_gate_on_attention: bool = False
    async_dp: bool = False
    # Serve an architecture missing from afd_common.vllm_glue.models.ARCHITECTURES (logged as a
    # warning).
    allow_untested_model: bool = False
    extra: ExtraConfig = field(default_factory=ExtraConfig)

    @property
    def is_attention(self) -> bool:
        return self.role == "attention"

    @property
    def is_ffn(self) -> bool:
        return self.role == "ffn"

    def with_extra(self, **changes: Any) -> AFDConfig:
        return replace(self, extra=replace(self.extra, **changes))


KEYS = ("role", "connector", "host", "port", "num_attention_ranks", "num_ffn_ranks",
        "compute_gate_on_attention", "async_dp", "allow_untested_model", "connector_extra_config")


def _canonical_keys(raw: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise AFDConfigError(str(key), value, "keys must be strings")
        canonical = ALIASES.get(key, key)
        if canonical not in KEYS:
            raise AFDConfigError(key, value, f"unknown key; known keys: {', '.join(KEYS)} "
                                 f"(aliases: {', '.join(ALIASES)})")
        if canonical in out:
            alias = key if canonical != key else next(a for a, c in ALIASES.items()
                                                       if c == canonical and a in raw)
            raise AFDConfigError(alias, value, f"is an alias of {canonical!r}, which is also "
                                 "given; write only one of them")
        out[canonical] = value
    return out


def parse_afd_config(raw: Any, *, resolve_connector: bool = True) -> AFDConfig:
    """Validate the ``afd`` mapping. With ``resolve_connector`` the connector name is looked up
    in the registry for this role, so an unknown name or an unsupported ``async_dp`` fails here."""
    if not isinstance(raw, Mapping):
        raise AFDConfigError("afd", raw, "must be a JSON object")
    values = _canonical_keys(raw)
    if "role" not in values:
        raise AFDConfigError("role", None, "is required (attention or ffn)")
    role = _check_str("role", values["role"], ROLES)
    connector = _check_str("connector", values.get("connector", DEFAULT_CONNECTOR))
    host = _check_str("host", values.get("host", "127.0.0.1"))
    if any(c.isspace() for c in host):
        raise AFDConfigError("host", host, "must not contain whitespace")
    port = _check_int("port", values.get("port", DEFAULT_PORT), 1, 65535)
    num_a = _check_int("num_attention_ranks", values.get("num_attention_ranks", 1), 1, 4096)
    num_f = _check_int("num_ffn_ranks", values.get("num_ffn_ranks", 1), 1, 4096)
    gate = _check_bool("compute_gate_on_attention", values.get("compute_gate_on_attention", False))
    async_dp = _check_bool("async_dp", values.get("async_dp", False))
    untested = _check_bool("allow_untested_model", values.get("allow_untested_model", False))

    connector_cls = None
    connector_keys: frozenset[str] = frozenset()
    if resolve_connector:
        connector_cls = registry.resolve_connector(connector, role)
        connector_keys = frozenset(getattr(connector_cls, "extra_config_keys", frozenset()))
    extra = parse_extra_config(values.get("connector_extra_config"), connector_keys)

    if connector_cls is not None:
        if async_dp and not getattr(connector_cls, "supports_async_dp", False):
            raise AFDConfigError("async_dp", async_dp, f"connector {connector!r} does not "
                                 "support async DP; use CAMAsyncAFDConnector or set it false")
        if getattr(connector_cls, "requires_gate_on_attention", False) and not gate:
            raise AFDConfigError("compute_gate_on_attention", gate, f"connector {connector!r} "
                                 "carries top-k routing and needs the gate on attention")
    return AFDConfig(role=role, connector=connector, host=host, port=port,
                     num_attention_ranks=num_a, num_ffn_ranks=num_f,
                     compute_gate_on_attention=gate, async_dp=async_dp,
                     allow_untested_model=untested, extra=extra)


def afd_config_from_vllm(vllm_config: Any) -> AFDConfig | None:
    """The AFD config of a vLLM config, or None when it has no ``afd`` section."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    if not isinstance(additional, Mapping) or "afd" not in additional:
        return None
    return parse_afd_config(additional["afd"])
