from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from kvasir.bridge.detokenizer import IncrementalDetokenizer, StreamDetokenizer, detokenizer
from tests.support.models import CORPUS


def both(tokenizer, skip: bool = True):
    """The context-decoding detokenizer, and the one a fast tokenizer gets (DecodeStream)."""
    fast = detokenizer(tokenizer, skip)
    assert isinstance(fast, StreamDetokenizer)
    return [IncrementalDetokenizer(tokenizer, skip), fast]


@pytest.mark.parametrize("kind", [0, 1], ids=["context", "stream"])
@pytest.mark.parametrize("skip", [True, False])
def test_deltas_rebuild_the_text_and_never_end_mid_character(tiny_models, kind, skip):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama-tokenizer"])
    rng = random.Random(0)
    sequences = [tokenizer.encode(text) for text in CORPUS[:4]]
    sequences += [[rng.randrange(len(tokenizer)) for _ in range(40)] for _ in range(20)]  # arbitrary bytes
    for ids in sequences:
        detok = both(tokenizer, skip)[kind]
        deltas = [detok.push(t) for t in ids]
        assert not any(d.endswith("\ufffd") for d in deltas)
        assert "".join(deltas) + detok.flush() == tokenizer.decode(ids, skip_special_tokens=skip)


def test_the_stream_gives_the_same_deltas_on_whole_characters(tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama-tokenizer"])
    for text in CORPUS[:4]:
        ids = tokenizer.encode(text) + [2]  # and the end of sequence
        context, stream = both(tokenizer)
        assert "".join(context.push(t) for t in ids) == "".join(stream.push(t) for t in ids)


@pytest.mark.parametrize("kind", [0, 1], ids=["context", "stream"])
def test_multibyte_characters_arrive_whole(tiny_models, kind):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama-tokenizer"])
    text = "🚀 日本語"
    ids = tokenizer.encode(text)
    detok = both(tokenizer)[kind]
    deltas = [d for d in (detok.push(t) for t in ids) if d]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
