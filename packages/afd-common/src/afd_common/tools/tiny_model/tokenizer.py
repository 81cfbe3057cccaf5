"""The tiny checkpoints' tokenizer: byte-level BPE trained on a short corpus, ids deterministic.

Its alphabet is printable ASCII and the newline, so every token is readable text: a tiny model's
random answers decode to word fragments ("valionsiet Qu tur5en wetple") instead of broken UTF-8
that makes a working demo look broken. ASCII text round-trips; other characters are dropped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from afd_common.tools.tiny_model.architectures import MAX_POSITIONS

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Written for this module; its only job is to give BPE a few hundred useful merges.
CORPUS = """\
The river runs past the old mill and under the stone bridge before it turns toward the sea. In the
morning the water is grey and quiet, and by noon it shines like a sheet of glass. Children walk
along the bank after school, counting boats and throwing small stones that skip three or four
times before they sink. Nobody remembers when the mill last turned, but everyone agrees that it
should be kept, because the town would not look like itself without it.

A computer does only what it is told, yet it can surprise the people who program it. A program is
a list of instructions, and each instruction is simple: add two numbers, compare them, copy a value
from one place in memory to another. The surprise comes from scale. When a machine performs
billions of these steps every second, patterns appear that no single step could explain, and the
engineers must test, measure and read logs to understand what their own system is doing.

Large language models are trained to predict the next word in a sentence. They read enormous
amounts of text and adjust millions of numbers, called weights, until their guesses improve. A
mixture of experts model splits part of each layer into many small networks, the experts, and a
router chooses which few of them should process each token. Only those experts run, so the model
can be large while each step stays cheap. Serving such a model efficiently means moving data
between machines quickly, keeping every processor busy, and never letting one slow part hold up
the rest.

Bread is one of the oldest foods we know. Flour, water, salt and yeast are mixed into a dough,
which is folded, left to rise, shaped and baked in a hot oven. The crust turns brown and crisp while
the inside stays soft. Bakers start work long before sunrise, and the smell of their ovens drifts
through the empty streets, telling the first travellers of the day that breakfast will soon be
ready.

The weather changed quickly that afternoon. Dark clouds gathered over the hills, the wind picked up
the dry leaves and carried them across the square, and the first heavy drops of rain struck the
windows. People hurried home with their collars raised. An hour later the storm had passed, the
sky was clear again, and the streets smelled of wet earth and fresh air. Questions, answers, numbers
like 1, 2, 3, 10, 42 and 2024, and short lists - red, green, blue - appear in every kind of writing.
"""



def readable_alphabet() -> list[str]:
    """Printable ASCII and the newline, as byte-level BPE writes bytes (GPT-2's byte-to-unicode
    map: a space is "Ġ", a newline "Ċ")."""
    printable = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    shifted = {b: 0x100 + i for i, b in enumerate(b for b in range(256) if b not in printable)}
    return [chr(shifted.get(b, b)) for b in [*range(0x20, 0x7F), 0x0A]]


def train_tokenizer(vocab_size: int) -> Any:
    """Byte-level BPE over a readable alphabet; specials first so their ids are small and
    fixed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD, *ROLE_TOKENS],
        initial_alphabet=readable_alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.split("\n\n"), trainer)
    # Prepend BOS the way Llama-style tokenizers do, so vLLM's prompts start with it.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def write_tokenizer(out: Path, tok: Any) -> None:
    tok.save(str(out / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "additional_special_tokens": list(ROLE_TOKENS),
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }
    write_json(out / "tokenizer_config.json", tok_config)
    write_json(out / "special_tokens_map.json",
                {**specials, "additional_special_tokens": list(ROLE_TOKENS)})




def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")

