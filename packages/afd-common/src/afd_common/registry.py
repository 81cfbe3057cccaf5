"""What the role packages register, found through entry points: one group per concept.

* Connectors: each package registers the halves it ships in the ``afd.connectors`` group, named
  ``"<role>:<ConnectorName>"`` (for example ``"ffn:P2pAFDConnector"``). That is the only place a
  connector's name is written: a third party adds a connector by shipping its own entry points,
  and an alias (``P2pNcclAFDConnector``) is one more entry point to the same class.
* Roles: each role package registers one ``RolePlugin`` in the ``afd.roles`` group, named after
  the role: its vLLM workers per platform and its hook into vLLM's config. afd_common never
  imports a role; this is how it reaches one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from afd_common.errors import AFDConfigError

#: The roles a connector has a half for.
ROLES: tuple[str, ...] = ("attention", "ffn")
GROUP = "afd.connectors"
ROLE_PACKAGES = {"attention": "afd-attention", "ffn": "afd-ffn"}
OUR_MODULES = {"afd_attention", "afd_ffn"}


@dataclass(frozen=True)
class ConnectorEntry:
    name: str
    role: str
    entry_point: EntryPoint

    @property
    def distribution(self) -> str | None:
        dist = getattr(self.entry_point, "dist", None)
        return dist.name if dist is not None else None


def installed_connectors() -> dict[str, dict[str, ConnectorEntry]]:
    """``{connector name: {role: entry}}`` of every half installed in this environment."""
    out: dict[str, dict[str, ConnectorEntry]] = {}
    for ep in entry_points(group=GROUP):
        role, sep, name = ep.name.partition(":")
        if not sep or role not in ROLES or not name:
            continue  # not ours to interpret; a malformed third-party name is ignored
        out.setdefault(name, {})[role] = ConnectorEntry(name, role, ep)
    return out


def resolve_connector(name: str, role: str) -> type[Any]:
    """The class implementing ``role``'s half of connector ``name``.

    Raises ``AFDConfigError`` (field ``connector``) listing the installed names when the name is
    unknown, or saying which package to install when only the other role's half is here.
    """
    installed = installed_connectors()
    halves = installed.get(name)
    if not halves:
        names = ", ".join(sorted(installed)) or "none (install afd-attention or afd-ffn)"
        raise AFDConfigError("connector", name, f"unknown connector; installed: {names}")
    entry = halves.get(role)
    if entry is None:
        other = next(iter(halves.values()))
        ours = (other.distribution in ROLE_PACKAGES.values()
                or other.entry_point.module.split(".")[0] in OUR_MODULES)
        package = ROLE_PACKAGES[role] if ours else (
            f"the {role} half shipped alongside {other.distribution or other.entry_point.value}")
        raise AFDConfigError("connector", name, f"its {role} half is not installed in this "
                             f"environment (only its {other.role} half is); install {package}")
    return entry.entry_point.load()


ROLE_GROUP = "afd.roles"


@dataclass(frozen=True)
class RolePlugin:
    """A role package's registration (``afd.roles``, named after the role)."""

    role: str
    #: The role's vLLM worker per platform kind ("cpu", "cuda"), as vLLM's ``worker_cls`` takes
    #: it ("module.Class"): chosen when vLLM completes its config, imported only by the worker.
    workers: Mapping[str, str]
    #: Runs where vLLM completes its config, after afd_common's checks, with the vLLM config and
    #: the role's ``AFDConfig``: the role's config-time changes (the attention role's async-DP
    #: engine patch).
    on_vllm_config: Callable[[Any, Any], None] = field(default=lambda vllm_config, afd: None)


def resolve_role(role: str) -> RolePlugin:
    """The installed plugin of ``role``; ``AFDConfigError`` (field ``role``) names the package
    to install when it is missing."""
    for ep in entry_points(group=ROLE_GROUP, name=role):
        return ep.load()
    raise AFDConfigError("role", role, f"the {role} role is not installed in this environment; "
                         f"install {ROLE_PACKAGES.get(role, 'its package')}")
