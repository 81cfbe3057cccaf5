"""``afd-tiny-model``'s negative control: a checkpoint differing only in its routed experts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from afd_common.tools.tiny_model import ARCHS, write_tiny_model


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


def test_every_token_is_readable_text_and_ascii_round_trips():
    """A tiny model's random answers must read as text, not as broken UTF-8 (the demo printed
    '\\ufffd\\ufffdsteld ever\\ufffdreried' before)."""
    from afd_common.tools.tiny_model.tokenizer import ROLE_TOKENS, train_tokenizer

    tok = train_tokenizer(512)
    assert tok.get_vocab_size() == 512  # the corpus fills it: no id is left without a token
    specials = {"<s>", "</s>", "<pad>", *ROLE_TOKENS}
    for i in range(tok.get_vocab_size()):
        if tok.id_to_token(i) in specials:
            continue
        text = tok.decode([i])
        assert text and all(c.isprintable() or c == "\n" for c in text) and text.isascii(), (i, text)
    prompt = "The river runs past the old mill: 42 boats, (red) & [blue]!\nNew line ~ tilde."
    assert tok.decode(tok.encode(prompt).ids, skip_special_tokens=True) == prompt


def test_the_demo_shows_each_servers_weights_by_category(tmp_path, capsys):
    """The demo's table: colocated vLLM holds the whole checkpoint, the attention role no routed
    expert, the FFN role only routed experts (the RSS alone hid it behind the KV cache)."""
    from afd_common.tools.demo import checkpoint_weights, print_weights

    model = write_tiny_model("deepseek_v2", tmp_path / "m", num_layers=2, num_experts=4)
    whole = checkpoint_weights(model)
    tensors = load_file(model / "model.safetensors")
    assert sum(e["bytes"] for e in whole.values()) == sum(t.nbytes for t in tensors.values())
    attention = {k: v for k, v in whole.items() if k != "routed_experts"}
    print_weights({"colocated": whole, "attention role": attention,
                   "FFN role": {"routed_experts": whole["routed_experts"]}})
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert rows["routed_experts"][1] == "-" and rows["routed_experts"][2] != "-"
    assert rows["attention"][2] == "-" and float(rows["total"][0]) > float(rows["total"][2]) > 0
