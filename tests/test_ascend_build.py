"""The afd-ascend-ops build hook's handling of the fused-kernel request (no compiler runs)."""

import importlib.util
from pathlib import Path

import pytest

HOOK = Path(__file__).resolve().parents[1] / "packages" / "afd-ascend-ops" / "hatch_build.py"


def hook():
    spec = importlib.util.spec_from_file_location("afd_ascend_build_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("env,needle", [
    ({"AFD_BUILD_ASCEND_OPS": "yes"}, "AFD_BUILD_ASCEND_OPS='yes'"),
    ({"AFD_BUILD_ASCEND_OPS": "1", "SOC_VERSION": "ascend310p"}, "SOC_VERSION='ascend310p'"),
    ({"AFD_BUILD_ASCEND_OPS": "1"}, "SOC_VERSION=''"),
    ({"AFD_BUILD_ASCEND_OPS": "1", "SOC_VERSION": "ascend910_9391"}, "not part of this release"),
    ({"AFD_BUILD_ASCEND_OPS": "1", "SOC_VERSION": "950"}, "not part of this release"),
])
def test_fused_kernel_requests_fail_clearly(env, needle):
    with pytest.raises(RuntimeError, match=needle.replace("(", r"\(")):
        hook().check_fused_request(env)


def test_portable_build_needs_nothing(capsys):
    h = hook()
    h.check_fused_request({})
    h.check_fused_request({"AFD_BUILD_ASCEND_OPS": "0", "ASCEND_HOME_PATH": "/opt/cann"})
    assert capsys.readouterr().err == ""
    h.check_fused_request({"ASCEND_HOME_PATH": "/opt/cann"})
    assert "portable kernels only" in capsys.readouterr().err
