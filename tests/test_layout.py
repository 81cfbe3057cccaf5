"""Package boundaries: common imports no role; a role never imports the other role."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "afd-common": {"afd_attention", "afd_ffn"},
    "afd-attention": {"afd_ffn"},
    "afd-ffn": {"afd_attention"},
    "afd-ascend-ops": {"afd_attention", "afd_ffn", "afd_common"},
}


def imported_modules(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0], node.lineno
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" \
                and node.args and isinstance(node.args[0], ast.Constant):
            yield str(node.args[0].value).split(".")[0], node.lineno


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_imports(package):
    files = sorted((ROOT / "packages" / package / "src").rglob("*.py"))
    assert files, f"no sources found for {package}"
    bad = [f"{f.relative_to(ROOT)}:{line} imports {mod}" for f in files
           for mod, line in imported_modules(f) if mod in FORBIDDEN[package]]
    assert not bad, "\n".join(bad)


def test_no_machine_paths_in_lock():
    text = (ROOT / "uv.lock").read_text()
    for marker in ('registry = "/', 'path = "/', "file:"):
        assert marker not in text


def _afd_modules() -> dict[str, Path]:
    out = {}
    for src in (ROOT / "packages").glob("*/src"):
        for f in src.rglob("*.py"):
            parts = list(f.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the afd modules it imports, anywhere in it (a lazy import is still a cycle:
    it only moves the failure to the first call)."""
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(resolve(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import module` imports the module, `from module import name` it
                deps.update(resolve(f"{node.module}.{a.name}") for a in node.names)
        graph[mod] = {d for d in deps if d and d != mod}
    return graph


def test_no_import_cycles_among_afd_modules():
    graph = _import_graph(_afd_modules())
    assert graph["afd_common.config"], "the graph sees imports"
    cycles = []

    def visit(mod, path, seen):
        for dep in sorted(graph[mod]):
            if dep in path:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in seen:
                seen.add(dep)
                visit(dep, path + [dep], seen)
    seen: set[str] = set()
    for mod in sorted(graph):
        if mod not in seen:
            seen.add(mod)
            visit(mod, [mod], seen)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_connector_half_is_more_than_four_afd_classes_deep():
    """A newcomer reads a half and at most three afd classes to know all it does: the world,
    the control plane and the I/O are values a half holds, not more base classes."""
    from afd_common.registry import installed_connectors

    deep = {}
    for name, halves in installed_connectors().items():
        for role, entry in halves.items():
            cls = entry.entry_point.load()
            chain = [c.__qualname__ for c in cls.__mro__
                     if c.__module__.split(".")[0] in ("afd_common", "afd_attention", "afd_ffn")]
            if len(chain) > 4:
                deep[f"{role}:{name}"] = " -> ".join(chain)
    assert not deep, deep


def test_only_the_tools_import_the_tools():
    """A role's container installs afd-common but never needs bench, demo or the tiny model."""
    graph = _import_graph(_afd_modules())
    bad = sorted(f"{m} imports {d}" for m, deps in graph.items() for d in deps
                 if d.startswith("afd_common.tools") and not m.startswith("afd_common.tools"))
    assert not bad, "\n".join(bad)


def test_no_role_specific_code_in_afd_common():
    """A module of afd_common that only one role imports (and no other module of afd_common)
    belongs in that role's package."""
    graph = _import_graph(_afd_modules())
    lonely = {}
    for mod in graph:
        if not mod.startswith("afd_common.") or mod.startswith("afd_common.tools"):
            continue
        importers = {m for m, deps in graph.items() if mod in deps}
        roles = {m.split(".")[0] for m in importers if not m.startswith("afd_common")}
        if len(roles) == 1 and importers and all(not m.startswith("afd_common")
                                                 for m in importers):
            lonely[mod] = sorted(importers)
    assert not lonely, lonely


def _names_used(modules: dict[str, Path]) -> set[str]:
    used = set()
    for path in modules.values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
    for toml in (ROOT / "packages").glob("*/pyproject.toml"):  # entry points name their targets
        used.update(re.findall(r':(\w+)"', toml.read_text()))
    return used


def test_tests_import_no_helper_the_product_does_not_use():
    """What the tests import from afd is what afd itself uses: helpers and fault injection that
    only tests need live under tests/ (op_world.py), and the product imports nothing from
    there."""
    modules = _afd_modules()
    used = _names_used(modules)
    test_modules = {f.stem for f in (ROOT / "tests").rglob("*.py")}
    test_only = []
    for f in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                test_only += [f"{f.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                              if f"{node.module}.{a.name}" not in modules and a.name not in used]
    assert not test_only, "\n".join(test_only)
    from_tests = [f"{m}: imports {name}" for m, path in modules.items()
                  for name, _ in imported_modules(path) if name in test_modules]
    assert not from_tests, from_tests
