"""Every field of the OpenAI completions and chat request schemas and vLLM's extensions is
honoured or refused with a 400 naming it; only fields with no effect on the output are
accepted and ignored (kvasir/http/fields.py). The lists below are written from the
schemas themselves, not from the code: a field the front drops silently fails here."""

from __future__ import annotations

import copy
import json

import msgspec
import pytest

from kvasir.http.errors import ApiError, from_validation
from kvasir.http.prompts import Prompts
from kvasir.http.requests import Served, plan_chat, plan_completion
from kvasir.http.schema import ChatRequest, CompletionRequest
from kvasir.http.tools import tool_style
from kvasir.wire.base import Grammar

SERVED = Served.of("tiny", 64, 4096, None, allow_ignore_eos=True)
SUBMITS = "changes the submissions"
FRONT = "honoured by the front's answer"  # streaming, echo, logprobs, stop strings...
IGNORED = "accepted, no effect on the output"
REFUSED = "refused, naming the field"

# field -> (a value that would act, what the front must do with it)
SHARED = {
    "model": ("tiny", FRONT),
    "max_tokens": (5, SUBMITS),
    "temperature": (0.5, SUBMITS),
    "top_p": (0.5, SUBMITS),
    "n": (2, SUBMITS),
    "seed": (7, SUBMITS),
    "stop": (["x"], FRONT),
    "stream": (True, FRONT),
    "stream_options": ({"include_usage": True}, FRONT),
    "user": ("someone", IGNORED),
    "frequency_penalty": (0.5, SUBMITS),
    "presence_penalty": (0.5, SUBMITS),
    "logit_bias": ({"5": 10}, SUBMITS),
    "response_format": ({"type": "json_object"}, SUBMITS),
    # vLLM's sampling extensions
    "top_k": (3, SUBMITS),
    "stop_token_ids": ([3], SUBMITS),
    "ignore_eos": (True, SUBMITS),
    "return_token_ids": (True, FRONT),
    "cache_salt": ("salt", SUBMITS),
    "use_beam_search": (True, REFUSED),
    "min_p": (0.1, SUBMITS),
    "repetition_penalty": (1.2, SUBMITS),
    "length_penalty": (0.5, REFUSED),
    "include_stop_str_in_output": (True, FRONT),
    "min_tokens": (3, SUBMITS),
    "skip_special_tokens": (False, SUBMITS),
    "spaces_between_special_tokens": (False, REFUSED),
    "truncate_prompt_tokens": (8, REFUSED),
    "prompt_logprobs": (1, REFUSED),
    "allowed_token_ids": ([1, 2], REFUSED),
    "bad_words": (["x"], SUBMITS),
    "logits_processors": (["x"], REFUSED),
    "return_tokens_as_token_ids": (True, REFUSED),
    "priority": (1, REFUSED),
    "request_id": ("abc", IGNORED),
    "kv_transfer_params": ({"a": 1}, REFUSED),
    "vllm_xargs": ({"a": 1}, REFUSED),
    "structured_outputs": ({"choice": ["a"]}, SUBMITS),
    "guided_json": ({"type": "object"}, SUBMITS),
    "guided_regex": ("a+", SUBMITS),
    "guided_choice": (["a"], SUBMITS),
    "guided_grammar": ("root ::= 'a'", SUBMITS),
    "guided_decoding_backend": ("xgrammar", REFUSED),
    "guided_whitespace_pattern": (" ", REFUSED),
}
COMPLETIONS = {
    **SHARED,
    "echo": (True, FRONT),
    "logprobs": (2, SUBMITS),
    "best_of": (3, REFUSED),
    "suffix": ("end", REFUSED),
    "add_special_tokens": (False, REFUSED),
    # chat's: not in the completions schema, so unknown here
    "tools": ([{"type": "function", "function": {"name": "f"}}], REFUSED),
    "tool_choice": ("required", REFUSED),
    "parallel_tool_calls": (False, REFUSED),
}
CHAT = {
    **SHARED,
    "tools": ([{"type": "function", "function": {"name": "f"}}], SUBMITS),  # the prompt lists them
    "tool_choice": ("required", REFUSED),  # without tools (with them: tests/unit/http/test_tools.py)
    "parallel_tool_calls": (False, IGNORED),  # no effect without tools
    "max_completion_tokens": (5, SUBMITS),
    "logprobs": (True, SUBMITS),
    "top_logprobs": (2, REFUSED),  # without logprobs: refused (with it, honoured: test below)
    "metadata": ({"k": "v"}, IGNORED),
    "store": (True, IGNORED),
    "service_tier": ("auto", IGNORED),
    "safety_identifier": ("h", IGNORED),
    "prompt_cache_key": ("conversation-1", SUBMITS),  # instance affinity
    "prompt_cache_retention": ("24h", IGNORED),
    "audio": ({"voice": "alloy", "format": "wav"}, REFUSED),
    "modalities": (["text", "audio"], REFUSED),
    "prediction": ({"type": "content", "content": "x"}, REFUSED),
    "reasoning_effort": ("low", REFUSED),
    "verbosity": ("low", REFUSED),
    "web_search_options": ({}, REFUSED),
    "functions": ([{"name": "f"}], REFUSED),
    "function_call": ("auto", REFUSED),
    # vLLM's chat extensions
    "echo": (True, REFUSED),
    "add_special_tokens": (True, REFUSED),
    "add_generation_prompt": (False, SUBMITS),
    "continue_final_message": (True, REFUSED),  # without add_generation_prompt = false (test below)
    "documents": ([{"text": "d"}], REFUSED),
    "chat_template": ("{{ messages }}", REFUSED),
    "chat_template_kwargs": ({"enable_thinking": False}, FRONT),  # to the template (test below)
    "mm_processor_kwargs": ({"a": 1}, REFUSED),
}
MESSAGE_FIELDS = {
    "name": ("bob", FRONT),  # given to the chat template (which may or may not render it)
    "tool_calls": ([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}], FRONT),
    "tool_call_id": ("c", FRONT),
    "function_call": ({"name": "f", "arguments": "{}"}, REFUSED),
    "reasoning_content": ("hm", FRONT),  # an assistant's earlier thinking, to the template
    "refusal": ("no", REFUSED),
    "audio": ({"id": "a"}, REFUSED),
}


def completions_plan(body: dict):
    req = msgspec.json.decode(json.dumps({"prompt": [1, 2, 3], **body}), type=CompletionRequest)
    return plan_completion(req, Prompts(None, 64, 1000), SERVED)


@pytest.fixture(scope="module")
def chat_plan(tiny_tokenizer):
    prompts = Prompts(tiny_tokenizer, 64, len(tiny_tokenizer), tool_style(tiny_tokenizer, "auto"))

    def plan(body: dict, message: dict | None = None):
        messages = [{"role": "user", "content": "hi", **(message or {})}]
        req = msgspec.json.decode(json.dumps({"messages": messages, **body}), type=ChatRequest)
        return plan_chat(req, prompts, SERVED)

    return plan


def outcome(plan, body: dict) -> tuple[str, object]:
    """What the front made of ``body``: ("refused", param) or ("planned", submissions)."""
    try:
        planned = plan(body)
    except ApiError as refused:
        return "refused", refused.param
    except msgspec.ValidationError as exc:
        return "refused", from_validation(exc).param
    return "planned", [(s.prompt, s.options) for s in planned.submissions]


def check(plan, field: str, value, expected: str) -> None:
    default = outcome(plan, {})
    got = outcome(plan, {field: value})
    if expected == REFUSED:
        assert got == ("refused", field), f"{field}={value!r} should be refused naming it, got {got}"
    elif expected == SUBMITS:
        assert got[0] == "planned" and got != default, f"{field}={value!r} did not reach the submissions"
    elif expected == IGNORED:
        assert got == default, f"{field}={value!r} is ignored yet changed the submissions"
    else:
        assert got[0] == "planned", f"{field}={value!r} was refused: {got}"


@pytest.mark.parametrize(("field", "case"), COMPLETIONS.items(), ids=list(COMPLETIONS))
def test_every_completions_field_is_honoured_or_refused(field, case):
    check(completions_plan, field, *case)


@pytest.mark.parametrize(("field", "case"), CHAT.items(), ids=list(CHAT))
def test_every_chat_field_is_honoured_or_refused(chat_plan, field, case):
    check(chat_plan, field, *case)


@pytest.mark.parametrize(("field", "case"), MESSAGE_FIELDS.items(), ids=list(MESSAGE_FIELDS))
def test_every_message_field_is_honoured_or_refused(chat_plan, field, case):
    value, expected = case
    got = outcome(lambda body: chat_plan(body, {field: value}), {})
    if expected == REFUSED:
        assert got == ("refused", f"messages[0].{field}")
    else:
        assert got[0] == "planned"


def test_fields_nobody_defines_are_refused_naming_them(chat_plan):
    assert outcome(completions_plan, {"temprature": 0.5}) == ("refused", "temprature")
    assert outcome(chat_plan, {"frequency_penality": 1}) == ("refused", "frequency_penality")
    nested = outcome(lambda body: chat_plan(body, {"colour": "red"}), {})
    assert nested == ("refused", "messages[0].colour")
    assert outcome(completions_plan, {"stream_options": {"continuous_usage_stats": True}})[0] == "refused"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("response_format", {"type": "text"}),
        ("use_beam_search", False),
        ("best_of", 1),
    ],
)
def test_a_field_not_served_is_accepted_at_a_value_that_changes_nothing(field, value):
    assert outcome(completions_plan, {field: value}) == outcome(completions_plan, {})


@pytest.mark.parametrize(("field", "value"), [("tools", []), ("tool_choice", "none"), ("parallel_tool_calls", False)])
def test_tool_fields_that_call_nothing_change_nothing(chat_plan, field, value):
    assert outcome(chat_plan, {field: value}) == outcome(chat_plan, {})


def test_top_logprobs_is_honoured_with_logprobs(chat_plan):
    plain, scored = outcome(chat_plan, {"logprobs": True}), outcome(chat_plan, {"logprobs": True, "top_logprobs": 3})
    assert scored[0] == "planned" and scored != plain


def test_a_refusal_says_why_and_shows_the_value():
    with pytest.raises(ApiError, match=r"best_of: best_of is not served \(sample n choices instead\) \(got 3\)"):
        completions_plan({"best_of": 3})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # a digit to str.isdigit(), not to int()
        ({"logit_bias": {"\u0665": 1}}, "logit_bias"),  # ARABIC-INDIC FIVE: int() reads it, ASCII only is served
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"bad_words": [""]}, "bad_words[0]"),
    ],
)
def test_shaping_values_out_of_range_are_refused_naming_them(body, param):
    assert outcome(completions_plan, body) == ("refused", param)


def test_the_shaping_reaches_the_submission_as_the_client_library_takes_it():
    [sub] = completions_plan(
        {"logit_bias": {"5": 10, "7": -2.5}, "bad_words": ["no"], "min_tokens": 2, "skip_special_tokens": False}
    ).submissions
    assert sub.options["logit_bias"] == {5: 10, 7: -2.5} and sub.options["bad_words"] == ["no"]
    assert sub.options["min_tokens"] == 2 and sub.options["skip_special_tokens"] is False


def test_structured_output_fields_become_one_grammar():
    def grammar(body):
        return completions_plan(body).submissions[0].options["grammar"]

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert grammar({"response_format": fmt}) == Grammar("json", json.dumps(schema))
    assert grammar({"response_format": {"type": "json_object"}}) == Grammar("json_object")
    assert grammar({"response_format": {"type": "text"}}) is None
    assert grammar({"structured_outputs": {"regex": "[a-z]+"}}) == Grammar("regex", "[a-z]+")
    assert grammar({"structured_outputs": {"choice": ["yes", "no"]}}) == Grammar("choice", '["yes", "no"]')
    assert grammar({"guided_grammar": "start: /x+/"}) == Grammar("grammar", "start: /x+/")
    two = {"response_format": {"type": "json_object"}, "guided_regex": "a"}
    assert outcome(completions_plan, two) == ("refused", "guided_regex")
    assert outcome(completions_plan, {"structured_outputs": {"regex": "a", "choice": ["b"]}}) == (
        "refused",
        "structured_outputs",
    )
    assert outcome(completions_plan, {"response_format": {"type": "json_schema"}}) == ("refused", "response_format")
    assert outcome(completions_plan, {"response_format": {"type": "xml"}}) == ("refused", "response_format.type")


def test_template_options_reach_the_template(tiny_tokenizer, chat_plan):
    open_end = outcome(chat_plan, {"continue_final_message": True, "add_generation_prompt": False})
    closed = outcome(chat_plan, {"add_generation_prompt": False})
    assert open_end[0] == closed[0] == "planned" and open_end != closed
    shouting = copy.deepcopy(tiny_tokenizer)
    shouting.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if shout %}!!{% endif %}"
    prompts = Prompts(shouting, 64, len(shouting))

    def ids(body):
        req = msgspec.json.decode(
            json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}), type=ChatRequest
        )
        return plan_chat(req, prompts, SERVED).submissions[0].prompt

    assert shouting.decode(ids({"chat_template_kwargs": {"shout": True}})).endswith("hi!!")
    assert shouting.decode(ids({})).endswith("hi")
    with pytest.raises(ApiError, match="may not set tokenize") as refused:
        ids({"chat_template_kwargs": {"tokenize": False}})
    assert refused.value.param == "chat_template_kwargs"
