"""Compile the ``afd_ascend`` op library into ``src/afd_ascend_ops/_C.so`` for wheels and editables.

A plain shared library (no Python module): ``afd_ascend_ops`` loads it with
``torch.ops.load_library``. It is compiled against the torch of the build environment, which the
build requirements pin to the runtime's torch (a C++ extension only loads into the torch it was
built with). Translation units compile in parallel; an unchanged build (same sources, torch and
flags) is reused, so ``uv sync`` after the first is free.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

HERE = Path(__file__).parent
CSRC = HERE / "csrc"
OUT = HERE / "src" / "afd_ascend_ops" / "_C.so"
STAMP = OUT.with_suffix(".stamp")
# The portable kernels and schemas; the fused CANN kernels are a separate, opt-in part.
SOURCES = ("schemas.cpp", "common.cpp", "cam_p2p.cpp", "cam_async.cpp")


def _flags():
    import torch

    root = Path(torch.__file__).parent  # not torch.utils.cpp_extension: it probes for CUDA
    include = [root / "include", root / "include" / "torch" / "csrc" / "api" / "include"]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cflags = ["-std=c++20", "-O2", "-fPIC", "-fvisibility=hidden", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
              "-DTORCH_API_INCLUDE_EXTENSION_H", "-Wall", "-Wno-unused-parameter",
              *[f"-isystem{p}" for p in include]]
    libdir = root / "lib"
    ldflags = ["-shared", f"-L{libdir}", "-lc10", "-ltorch_cpu", "-ltorch",
               "-Wl,-rpath,$ORIGIN/../torch/lib"]  # torch itself is loaded first anyway
    return torch.__version__, cflags, ldflags


def build_library(verbose: bool = False) -> Path:
    version, cflags, ldflags = _flags()
    cxx = os.environ.get("CXX", "c++")
    digest = hashlib.sha256()
    # Not the include/library paths: every isolated build env has its own copy of the same torch.
    for part in (version, cxx, *cflags, *ldflags):
        if not part.startswith(("-isystem", "-L")):
            digest.update(part.encode())
    for src in sorted(CSRC.rglob("*")):
        if src.is_file():
            digest.update(src.name.encode() + src.read_bytes())
    stamp = digest.hexdigest()
    if OUT.exists() and STAMP.exists() and STAMP.read_text() == stamp:
        return OUT
    objdir = HERE / "build" / "obj"
    objdir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    print(f"afd-ascend-ops: compiling the afd_ascend op library against torch {version} "
          f"({len(SOURCES)} units, {os.cpu_count()} cores) ...", file=sys.stderr, flush=True)

    def compile_one(name: str) -> Path:
        obj = objdir / (name + ".o")
        cmd = [cxx, *cflags, "-c", str(CSRC / name), "-o", str(obj)]
        if verbose:
            print(shlex.join(cmd), file=sys.stderr)
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"afd-ascend-ops: compiling {name} failed:\n{run.stderr[-8000:]}")
        return obj

    with ThreadPoolExecutor(max_workers=max(1, min(len(SOURCES), os.cpu_count() or 1))) as pool:
        objs = list(pool.map(compile_one, SOURCES))
    tmp = OUT.with_suffix(".so.tmp")
    link = subprocess.run([cxx, *map(str, objs), *ldflags, "-o", str(tmp)],
                          capture_output=True, text=True)
    if link.returncode != 0:
        raise RuntimeError(f"afd-ascend-ops: linking failed:\n{link.stderr[-8000:]}")
    tmp.replace(OUT)
    STAMP.write_text(stamp)
    print(f"afd-ascend-ops: built {OUT.name} in {time.monotonic() - start:.0f} s",
          file=sys.stderr, flush=True)
    return OUT


# SOC_VERSION values the fused kernels would target, by family.
SOC_FAMILIES = {"910c": "ascend910_93", "950": "ascend950"}


def check_fused_request(env=os.environ) -> None:
    """The fused CANN kernels: requested with AFD_BUILD_ASCEND_OPS=1 (a found CANN toolkit alone
    only prints a notice). They are not written yet, so a valid request is refused with a clear
    error instead of silently building only the portable kernels; a bad SOC_VERSION is named."""
    cann = env.get("ASCEND_HOME_PATH") or env.get("ASCEND_TOOLKIT_HOME")
    flag = env.get("AFD_BUILD_ASCEND_OPS", "")
    if flag not in ("", "0", "1"):
        raise RuntimeError(f"AFD_BUILD_ASCEND_OPS={flag!r}: use 1 (build the fused kernels) or 0")
    if flag != "1":
        if cann and flag != "0":
            print(f"afd-ascend-ops: CANN toolkit found at {cann}; building the portable kernels "
                  "only (fused CANN kernels are not part of this release)", file=sys.stderr)
        return
    soc = env.get("SOC_VERSION", "")
    if not any(soc == fam or soc.startswith(prefix) for fam, prefix in SOC_FAMILIES.items()):
        raise RuntimeError(f"SOC_VERSION={soc!r}: the fused kernels target 910c "
                           "(ascend910_93*) or 950 (ascend950*)")
    raise RuntimeError(f"AFD_BUILD_ASCEND_OPS=1 (SOC_VERSION={soc}): the fused CANN kernels are "
                       "not part of this release; unset AFD_BUILD_ASCEND_OPS to build the "
                       "portable kernels, which run on an NPU through torch-npu (HCCL)")


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel":
            return  # the sdist ships csrc/ and this hook; the wheel is where code is compiled
        check_fused_request()
        out = build_library()
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if version != "editable":  # an editable install finds _C.so in src/ through its .pth
            build_data["force_include"][str(out)] = "afd_ascend_ops/_C.so"


if __name__ == "__main__":  # `python hatch_build.py` rebuilds in place, for C++ development
    build_library(verbose="-v" in sys.argv)
