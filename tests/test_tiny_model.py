"""``afd-tiny-model``'s negative control: a checkpoint differing only in its routed experts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from afd_common.tiny_model import ARCHS, write_tiny_model


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_experts_seed_changes_the_routed_experts_only(arch, tmp_path):
    shape = {"num_layers": 2, "num_experts": 4}
    base = write_tiny_model(arch, tmp_path / "base", **shape)
    other = write_tiny_model(arch, tmp_path / "other", experts_seed=1, **shape)
    assert json.loads((base / "config.json").read_text())["architectures"] == [ARCHS[arch]]
    a, b = load_file(base / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    routed = {name for name in a if ".experts." in name}  # not shared_expert(s)
    assert routed and all(not torch.equal(a[n], b[n]) for n in routed)
    assert all(torch.equal(a[n], b[n]) for n in a.keys() - routed)
