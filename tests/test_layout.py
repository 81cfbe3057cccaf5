"""Package boundaries: common imports no role; a role never imports the other role."""

import ast
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
