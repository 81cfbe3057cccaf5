"""The Kubernetes recipe (deploy/kubernetes/): every document is valid against the Kubernetes API
schema, and each pod's start script, run with the cluster's names resolved to the README's
addresses, gives exactly the README's four-node command lines, whose AFD config afd accepts."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from afd_common.config import parse_afd_config

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
K8S_VERSION = kubernetes_validate.utils.latest_version()
# The cluster's names as the README's four-node recipe addresses them.
ADDRESSES = {"afd-attention-0.afd-attention-pods": "10.0.0.1", "afd-ffn-0.afd-ffn": "10.0.0.3"}


def documents() -> list[dict]:
    return [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]


def test_every_document_is_valid_for_the_kubernetes_api():
    docs = documents()
    assert MANIFESTS and {d["kind"] for d in docs} == {"Service", "StatefulSet"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_schema_check_can_fail():
    doc = copy.deepcopy(next(d for d in documents() if d["kind"] == "StatefulSet"))
    doc["spec"]["template"]["spec"]["containers"][0]["comand"] = ["vllm"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def render(statefulset: dict, ordinal: int, tmp_path: Path) -> list[str]:
    """The argv the pod ``ordinal`` of ``statefulset`` would exec, with getent and vllm stubbed."""
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    cases = "".join(f"  {name}) echo '{ip}  {name}' ;;\n" for name, ip in ADDRESSES.items())
    (bin_dir / "getent").write_text(f'#!/bin/sh\ncase "$2" in\n{cases}  *) exit 2 ;;\nesac\n')
    (bin_dir / "vllm").write_text("#!/bin/sh\nfor a in \"$@\"; do printf '%s\\0' \"$a\"; done\n")
    for stub in ("getent", "vllm"):
        (bin_dir / stub).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}",
           "POD_NAME": f"{statefulset['metadata']['name']}-{ordinal}"}
    out = subprocess.run([*container["command"], *container["args"]], env=env, timeout=30,
                         capture_output=True, text=True, check=True).stdout
    return ["vllm", *out.split("\0")[:-1]]


def readme_commands() -> list[list[str]]:
    """The four-node recipe's ``vllm serve`` lines, as argv."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- four-node -->\n```bash\n(.*?)```", text, re.S)
    assert block, "README: the four-node recipe block is missing"
    lines = block.group(1).replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if line.startswith("vllm serve")]


def test_each_pod_runs_the_readme_command_and_afd_accepts_its_config(tmp_path):
    sets = {d["metadata"]["name"]: d for d in documents() if d["kind"] == "StatefulSet"}
    rendered = [render(sets[name], rank, tmp_path) for name in ("afd-ffn", "afd-attention")
                for rank in range(sets[name]["spec"]["replicas"])]
    assert rendered == readme_commands()
    configs = {}
    for argv in rendered:
        afd = json.loads(argv[argv.index("--additional-config") + 1])["afd"]
        config = parse_afd_config(afd)
        dp = int(argv[argv.index("--data-parallel-size") + 1])
        assert dp == (config.num_attention_ranks if config.is_attention
                      else config.num_ffn_ranks)
        assert dp == sets[f"afd-{config.role}"]["spec"]["replicas"]
        assert config.host == ADDRESSES["afd-ffn-0.afd-ffn"]
        configs.setdefault(config.role, afd)
    assert {k: v for k, v in configs["ffn"].items() if k != "role"} == \
        {k: v for k, v in configs["attention"].items() if k != "role"}
