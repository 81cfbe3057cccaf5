"""Per-role installs as containers do them: each role's wheel into a fresh venv with plain pip.

torch is not downloaded: the fresh venv sees the workspace's third-party packages through a
.pth file that lists a folder of links to them, with every afd package left out, so pip must
install afd-common and the role from the built wheels and nothing else.
"""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    for pkg in ("afd-common", "afd-attention", "afd-ffn", "afd-ascend-ops"):
        subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation",
                        "--outdir", str(out), str(ROOT / "packages" / pkg)],
                       check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def third_party(tmp_path_factory):
    """A folder of links to the workspace's installed packages, minus every afd package."""
    site = Path(sysconfig.get_paths()["purelib"])
    folder = tmp_path_factory.mktemp("third_party")
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith(("afd", "_afd", "__editable__", "_editable_impl_afd")) or \
                name.endswith(".pth"):
            continue
        (folder / entry.name).symlink_to(entry)
    return folder


def test_ascend_ops_wheel_carries_the_compiled_library(wheels):
    import zipfile

    (wheel,) = wheels.glob("afd_ascend_ops-*.whl")
    assert "-py3-none-any" not in wheel.name, "a compiled library makes a platform wheel"
    assert "afd_ascend_ops/_C.so" in zipfile.ZipFile(wheel).namelist()


def test_common_wheel_carries_the_compiled_one_link_path(wheels):
    import zipfile

    (wheel,) = wheels.glob("afd_common-*.whl")
    assert "-py3-none-any" not in wheel.name, "a compiled module makes a platform wheel"
    assert [n for n in zipfile.ZipFile(wheel).namelist()
            if n.startswith("afd_common/transport/_one_link") and n.endswith(".so")]


def test_common_wheel_without_a_compiler_is_pure_python(tmp_path):
    import os
    import zipfile

    run = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
                          str(tmp_path), str(ROOT / "packages" / "afd-common")],
                         capture_output=True, text=True, env={**os.environ, "CXX": "no-such-c++"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no C++ compiler (no-such-c++)" in run.stderr
    (wheel,) = tmp_path.glob("afd_common-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so")]


@pytest.mark.parametrize("role,other", [("attention", "ffn"), ("ffn", "attention")])
def test_role_installs_alone(role, other, wheels, third_party, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # The venv's own old setuptools would shadow the workspace's (torch needs >= 77).
    subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], check=True,
                   capture_output=True)
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True)
    Path(purelib.stdout.strip(), "zz_third_party.pth").write_text(str(third_party) + "\n")
    pip = subprocess.run([str(py), "-m", "pip", "install", "--isolated", "--no-index", "--find-links",
                          str(wheels), f"afd-{role}"], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    check = f"""
import importlib.util, json
from importlib.metadata import distributions
from afd_common.registry import installed_connectors, resolve_connector, resolve_role
from afd_common.transport import one_link
import afd_{role}
names = sorted(d.metadata["Name"] for d in distributions() if d.metadata["Name"].startswith("afd"))
halves = {{n: sorted(h) for n, h in installed_connectors().items()}}
cls = resolve_connector("P2pAFDConnector", "{role}")
workers = resolve_role("{role}").workers
print(json.dumps({{"names": names, "halves": halves, "cls": cls.__module__,
                  "workers": sorted(workers.values()), "compiled": one_link.available(),
                  "other": importlib.util.find_spec("afd_{other}") is not None}}))
"""
    out = subprocess.run([str(py), "-c", check], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["names"] == sorted(["afd-common", f"afd-{role}"])
    assert got["halves"]["P2pAFDConnector"] == [role]
    assert got["cls"] == f"afd_{role}.p2p_connector"
    assert got["other"] is False
    assert got["compiled"] is True  # the one-link path, built into afd-common's wheel
    assert got["workers"] and all(w.startswith(f"afd_{role}.") for w in got["workers"])
    wrong = subprocess.run([str(py), "-c", "from afd_common.registry import resolve_connector;"
                            f"resolve_connector('P2pAFDConnector', '{other}')"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert f"install afd-{other}" in wrong.stderr
    no_role = subprocess.run([str(py), "-c", "from afd_common.registry import resolve_role;"
                              f"resolve_role('{other}')"], capture_output=True, text=True,
                             cwd=tmp_path)
    assert f"install afd-{other}" in no_role.stderr
