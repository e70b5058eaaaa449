from __future__ import annotations

import random

from transformers import AutoTokenizer

from kvasir.bridge.detokenizer import IncrementalDetokenizer
from tests.support.models import CORPUS


def test_deltas_rebuild_the_text_and_never_end_mid_character(tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama-tokenizer"])
    rng = random.Random(0)
    sequences = [tokenizer.encode(text) for text in CORPUS[:4]]
    sequences += [[rng.randrange(len(tokenizer)) for _ in range(40)] for _ in range(20)]  # arbitrary bytes
    for ids in sequences:
        detok = IncrementalDetokenizer(tokenizer)
        deltas = [detok.push(t) for t in ids]
        assert not any(d.endswith("\ufffd") for d in deltas)
        assert "".join(deltas) + detok.flush() == tokenizer.decode(ids, skip_special_tokens=True)


def test_multibyte_characters_arrive_whole(tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama-tokenizer"])
    text = "🚀 日本語"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [d for d in (detok.push(t) for t in ids) if d]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
