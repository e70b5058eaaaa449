"""From OpenAI request bodies to the bridge's submissions, and errors as OpenAI bodies."""

from __future__ import annotations

import json

import msgspec
import pytest

from kvasir.http.errors import ApiError, from_validation
from kvasir.http.prompts import Prompts
from kvasir.http.requests import Served, plan_chat, plan_completion
from kvasir.http.schema import ChatRequest, CompletionRequest

SERVED = Served.of("tiny", 64, 4096, None)
IDS = Prompts(None, 64, 1000)  # a model without a tokenizer: token ids only


def completion(**body) -> CompletionRequest:
    return msgspec.json.decode(json.dumps(body), type=CompletionRequest)


def test_prompt_forms_times_n_make_the_choices_in_openais_order():
    planned = plan_completion(completion(prompt=[[1, 2], [3]], n=2, seed=10, max_tokens=4), IDS, SERVED)
    assert [(s.index, s.prompt) for s in planned.submissions] == [(0, [1, 2]), (1, [1, 2]), (2, [3]), (3, [3])]
    assert [s.options["seed"] for s in planned.submissions] == [10, 11, 10, 11]
    assert planned.prompt_tokens == 3 and {s.options["max_tokens"] for s in planned.submissions} == {4}
    single = plan_completion(completion(prompt=[7, 8, 9], top_k=-1), IDS, SERVED)
    [only] = single.submissions
    assert only.prompt == [7, 8, 9] and only.options["max_tokens"] == 16 and only.options["top_k"] == 0
    assert only.options["temperature"] == 1.0 and only.options["seed"] is None


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"prompt": "text"}, "invalid_request", None),  # no tokenizer
        ({"prompt": []}, "invalid_request", "prompt"),
        ({"prompt": [1, "a"]}, "invalid_request", "prompt"),
        ({"prompt": [1], "n": 0}, "invalid_request", "n"),
        ({"prompt": [1], "n": 17}, "invalid_request", "n"),
        ({"prompt": [[1]] * 20, "n": 16}, "invalid_request", "n"),
        ({"prompt": [[1]] * 6, "n": 3}, "invalid_request", "n"),  # 18 generations: over http.max_choices
        ({"prompt": [1], "max_tokens": 4097}, "invalid_request", "max_tokens"),
        ({"prompt": [1], "ignore_eos": True}, "invalid_request", "ignore_eos"),
        ({"prompt": [1], "model": "other"}, "model_not_found", "model"),
    ],
)
def test_refusals(body, code, param):
    with pytest.raises(ApiError) as refused:
        plan_completion(completion(**body), IDS, SERVED)
    assert (refused.value.code, refused.value.param) == (code, param)
    assert refused.value.status in (400, 404)


def test_chat_without_max_tokens_gets_the_rest_of_the_context_within_the_ceiling(tiny_tokenizer):
    prompts = Prompts(tiny_tokenizer, 64, len(tiny_tokenizer))
    req = msgspec.json.decode(
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}', type=ChatRequest
    )
    [sub] = plan_chat(req, prompts, SERVED).submissions
    assert sub.options["max_tokens"] == 64 - len(sub.prompt)
    [capped] = plan_chat(req, prompts, Served.of("tiny", 64, 4096, 5)).submissions
    assert capped.options["max_tokens"] == 5
    over = msgspec.json.decode(b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 6}', type=ChatRequest)
    with pytest.raises(ApiError, match=r"ceiling of 5 \(bridge.max_tokens_per_request\)"):
        plan_chat(over, prompts, Served.of("tiny", 64, 4096, 5))
    with pytest.raises(ApiError, match=r"ceiling of 5 \(http.max_tokens\)"):
        plan_chat(over, prompts, Served.of("tiny", 64, 5, 9))
    bad = msgspec.json.decode(b'{"messages": [{"role": "wizard", "content": "x"}]}', type=ChatRequest)
    with pytest.raises(ApiError, match="role"):
        plan_chat(bad, prompts, SERVED)


def test_a_body_that_does_not_decode_names_the_field():
    with pytest.raises(msgspec.ValidationError) as exc:
        completion(prompt=[1], temperature="hot")
    error = from_validation(exc.value)
    assert (error.status, error.param) == (400, "temperature")
    assert json.loads(error.body())["error"]["type"] == "invalid_request_error"
    with pytest.raises(msgspec.DecodeError) as junk:
        msgspec.json.decode(b"{not json", type=CompletionRequest)
    assert from_validation(junk.value).message.startswith("the body is not valid JSON")
    busy = ApiError("restarting", "later")
    assert busy.status == 503 and busy.headers == {"Retry-After": "5"}
    assert ApiError("overloaded", "x").status == 429 and ApiError("stage_failed", "x").status == 500
