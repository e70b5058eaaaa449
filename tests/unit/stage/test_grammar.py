"""Structured output at the tail (kvasir/stage/grammar.py): whatever the logits say, the
sampled output stays inside its grammar and ends where the grammar is complete; a matcher
rebuilt from the output so far (a decode pool's tail) continues exactly."""

from __future__ import annotations

import json
import re

import pydantic
import pytest
import torch

from kvasir.errors import RequestError
from kvasir.sched.grammar import check_grammar
from kvasir.stage.grammar import Grammars
from kvasir.stage.sampling import RequestSampler
from kvasir.wire.base import Grammar
from kvasir.wire.batch import NewRequest, SamplingParams
from tests.support.models import save_tiny_tokenizer


class Order(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    item: str = pydantic.Field(max_length=16)  # random logits never end a string of their own accord
    count: int = pydantic.Field(ge=0, le=10**6)
    size: str = pydantic.Field(json_schema_extra={"enum": ["s", "m", "l"]})
    extras: list[bool] = pydantic.Field(max_length=4)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def grammars(tokenizer_folder):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    return Grammars(tokenizer_folder, len(tokenizer)), tokenizer


def generate(sampler: RequestSampler, vocab: int, seed: int, limit: int = 400) -> tuple[list[int], str | None]:
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(limit):
        token = sampler.pick(torch.randn(vocab, generator=gen) * 4)
        out.append(token)
        reason = sampler.finish(token, len(out) + 1)
        if reason is not None:
            return out, reason
    return out, None


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_output_always_validates(grammars, seed):
    engine, tokenizer = grammars
    params = SamplingParams(
        temperature=1.0, max_tokens=400, grammar=Grammar("json", json.dumps(Order.model_json_schema()))
    )
    sampler = RequestSampler(NewRequest(1, params, seed), (2,), 10_000, engine)
    out, reason = generate(sampler, len(tokenizer), seed)
    assert reason == "stop", tokenizer.decode(out)
    Order.model_validate_json(tokenizer.decode(out, skip_special_tokens=True))


@pytest.mark.parametrize(
    ("grammar", "check"),
    [
        (Grammar("regex", "[a-c]{2,5}-[0-9]{3}"), lambda text: re.fullmatch("[a-c]{2,5}-[0-9]{3}", text)),
        (Grammar("choice", '["north", "south", "east west"]'), lambda text: text in ("north", "south", "east west")),
        (
            Grammar("grammar", 'start: "(" /[0-9]+/ ("," /[0-9]+/)* ")"'),
            lambda text: re.fullmatch(r"\(\d+(,\d+)*\)", text),
        ),
    ],
)
def test_regex_choice_object_and_grammar_outputs_match(grammars, grammar, check):
    engine, tokenizer = grammars
    for seed in range(4):
        params = SamplingParams(temperature=1.0, max_tokens=200, grammar=grammar)
        out, reason = generate(RequestSampler(NewRequest(1, params, seed), (2,), 10_000, engine), len(tokenizer), seed)
        text = tokenizer.decode(out, skip_special_tokens=True)
        assert reason == "stop" and check(text), text


def test_a_matcher_rebuilt_from_the_output_so_far_continues_exactly(grammars):
    engine, tokenizer = grammars
    params = SamplingParams(
        temperature=0, max_tokens=400, grammar=Grammar("json", json.dumps(Order.model_json_schema()))
    )
    whole, _ = generate(RequestSampler(NewRequest(1, params, 0), (2,), 10_000, engine), len(tokenizer), 9)
    gen = torch.Generator().manual_seed(9)
    logits = [torch.randn(len(tokenizer), generator=gen) * 4 for _ in whole]
    taken = RequestSampler(NewRequest(1, params, 0, 3, output=tuple(whole[:3])), (2,), 10_000, engine)
    rest = []
    for k, row in enumerate(logits[3:], start=3):
        rest.append(taken.pick(row))
        if taken.finish(rest[-1], k + 2) is not None:
            break
    assert whole[:3] + rest == whole


@pytest.mark.parametrize(
    ("grammar", "says"),
    [
        (Grammar("regex", "[0-9"), "does not compile"),
        (Grammar("json", '{"type": "bogus"}'), "does not compile"),
        (Grammar("choice", "[]"), "one or more strings"),
        (Grammar("choice", '{"a": 1}'), "one or more strings"),
        (Grammar("grammar", "start: missing"), "does not compile"),
        (Grammar("regex", "a" * 70_000), "at most"),
    ],
)
def test_grammars_that_do_not_compile_are_refused_with_the_engines_words(grammar, says):
    with pytest.raises(RequestError, match=says):
        check_grammar(grammar)


def test_any_json_object_parses_where_it_ends(grammars):
    engine, tokenizer = grammars
    for seed in range(8):
        params = SamplingParams(temperature=1.0, max_tokens=120, grammar=Grammar("json_object"))
        out, reason = generate(
            RequestSampler(NewRequest(1, params, seed), (2,), 10_000, engine), len(tokenizer), seed, 300
        )
        assert reason in ("stop", "length") and isinstance(
            json.loads(tokenizer.decode(out, skip_special_tokens=True)), dict
        )


@pytest.mark.parametrize("max_tokens", [48, 60, 75, 100, 130])
def test_max_tokens_never_cuts_a_structured_output_short(grammars, max_tokens):
    """Random logits that favour opening more (long strings, arrays): near the budget's end
    the tail turns to closing, so every answer parses and validates, ``length`` or not."""
    engine, tokenizer = grammars
    schema = json.dumps(Order.model_json_schema())
    opening = torch.tensor(
        [text[:1] in ("[", "{", ",", "t", "a") for text in map(tokenizer.decode, [[t] for t in range(len(tokenizer))])]
    )
    for seed in range(4):
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, grammar=Grammar("json", schema))
        sampler = RequestSampler(NewRequest(1, params, seed), (2,), 10_000, engine)
        gen = torch.Generator().manual_seed(seed)
        out: list[int] = []
        reason = None
        while reason is None:
            out.append(sampler.pick(torch.randn(len(tokenizer), generator=gen) * 4 + opening * 6.0))
            reason = sampler.finish(out[-1], len(out) + 1)
        assert len(out) <= max_tokens and reason in ("stop", "length")
        Order.model_validate_json(tokenizer.decode(out, skip_special_tokens=True))
