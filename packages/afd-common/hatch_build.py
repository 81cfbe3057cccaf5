"""Compile the P2P connector's one-link round trip (``csrc/one_link.cpp``) into
``src/afd_common/transport/_one_link*.so`` for wheels and editables.

Optional: where no C++ compiler is found (a slim container) the wheel is pure Python and the
connector runs its Python path (``afd_common.transport.one_link``); ``AFD_BUILD_ONE_LINK=0``
skips it on purpose. A compiler that fails is an error, not a silent fallback. The module only
loads into the torch and Python it was built against: the build requirements pin torch (so a
build from source installs it into the build environment, compiler or not; the workspace runs
that torch), ``afd_common.transport.one_link`` refuses the module under another torch release,
and an unchanged build (same source, torch, Python, compiler and flags) is reused, so
``uv sync`` after the first is free.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

HERE = Path(__file__).parent
SOURCE = HERE / "csrc" / "one_link.cpp"
OUT = HERE / "src" / "afd_common" / "transport" / ("_one_link" + sysconfig.get_config_var(
    "EXT_SUFFIX"))
STAMP = OUT.parent / "_one_link.stamp"


def _command():
    import torch

    root = Path(torch.__file__).parent  # not torch.utils.cpp_extension: it probes for CUDA
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -O2: at -O0 the compiled round trip measured slower than the Python one.
    flags = ["-std=c++20", "-O2", "-fPIC", "-shared", "-fvisibility=hidden",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-Wall", "-Wno-unused-parameter"]
    includes = [f"-isystem{p}" for p in (root / "include",
                                          root / "include" / "torch" / "csrc" / "api" / "include",
                                          sysconfig.get_paths()["include"])]
    # torch is imported first anyway; the rpath lets the module load on its own in a wheel too.
    libs = [f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python",
            "-Wl,-rpath,$ORIGIN/../../torch/lib"]
    return torch.__version__, flags, includes, libs


def build_module(verbose: bool = False) -> Path | None:
    """The module's path, or None where it is not built (no compiler, or skipped)."""
    if os.environ.get("AFD_BUILD_ONE_LINK", "") == "0":
        print("afd-common: AFD_BUILD_ONE_LINK=0, the P2P connector's one-link path stays Python",
              file=sys.stderr)
        return None
    cxx = shlex.split(os.environ.get("CXX", "c++"))  # "ccache g++" too
    if not cxx or shutil.which(cxx[0]) is None:
        print(f"afd-common: no C++ compiler ({shlex.join(cxx)}): the P2P connector's one-link "
              "path stays Python (install one and reinstall afd-common to compile it)",
              file=sys.stderr)
        return None
    version, flags, includes, libs = _command()
    digest = hashlib.sha256()
    # Not the include/library paths: every isolated build env has its own copy of the same torch.
    for part in (version, sys.version, *cxx, *flags, *libs, SOURCE.read_text()):
        if not part.startswith("-L"):
            digest.update(part.encode())
    stamp = digest.hexdigest()
    if OUT.exists() and STAMP.exists() and STAMP.read_text() == stamp:
        return OUT
    start = time.monotonic()
    print(f"afd-common: compiling the P2P one-link path against torch {version} ...",
          file=sys.stderr, flush=True)
    tmp = OUT.with_name(OUT.name + ".tmp")
    cmd = [*cxx, *flags, *includes, str(SOURCE), *libs, "-o", str(tmp)]
    if verbose:
        print(shlex.join(cmd), file=sys.stderr)
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"afd-common: compiling {SOURCE.name} failed (AFD_BUILD_ONE_LINK=0 "
                           f"skips it):\n{run.stderr[-8000:]}")
    tmp.replace(OUT)
    STAMP.write_text(stamp)
    print(f"afd-common: built {OUT.name} in {time.monotonic() - start:.0f} s", file=sys.stderr,
          flush=True)
    return OUT


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel":
            return  # the sdist ships csrc/ and this hook; the wheel is where code is compiled
        out = build_module()
        if out is None:
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if version != "editable":  # an editable install finds the module in src/ through its .pth
            build_data["force_include"][str(out)] = f"afd_common/transport/{out.name}"


if __name__ == "__main__":  # `python hatch_build.py` rebuilds in place, for C++ development
    build_module(verbose="-v" in sys.argv)
