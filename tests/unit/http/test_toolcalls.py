"""Tool calls read out of streamed text (kvasir/http/toolcalls.py): the same calls and
content whatever the text's cut into pieces."""

from __future__ import annotations

import json
import random

import pytest

from kvasir.http.toolcalls import HermesCalls, JsonCalls, Parsed, parser


def read(form: str, text: str, single: bool = False, seed: int = 0) -> tuple[str, list[tuple[str, dict]], bool]:
    """Content, (name, arguments) of each call, and whether the reader was done early."""
    chooser = random.Random(seed)
    reader = parser(form, single)  # type: ignore[arg-type]
    content, calls, at = "", [], 0
    while at < len(text) and not reader.done:
        step = chooser.randint(1, 7)
        got = reader.push(text[at : at + step])
        at += step
        content, calls = content + got.content, calls + got.calls
    done = reader.done
    rest = reader.flush()
    content, calls = content + rest.content, calls + rest.calls
    return content, [(call.name, json.loads(call.arguments)) for call in calls], done


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'


@pytest.mark.parametrize("seed", range(8))
def test_hermes_calls_and_the_text_before_them(seed):
    text = f"Let me look.\n{CALL}\n{CALL.replace('Oslo', 'Bergen')}\n"
    content, calls, _ = read("hermes", text, seed=seed)
    assert content == "Let me look.\n"
    assert calls == [("get_weather", {"city": "Oslo", "days": 2}), ("get_weather", {"city": "Bergen", "days": 2})]


@pytest.mark.parametrize("seed", range(4))
def test_text_like_a_tag_that_is_not_one_stays_content(seed):
    text = "a < b and <tool> <tool_cal is no call"
    assert read("hermes", text, seed=seed) == (text, [], False)


def test_a_call_that_does_not_read_stays_in_the_content_as_written():
    broken = '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>'
    assert read("hermes", "hi " + broken) == ("hi " + broken, [], False)
    not_a_call = '<tool_call>\n{"arguments": {}}\n</tool_call>'
    assert read("hermes", not_a_call)[1] == []


def test_an_unclosed_call_that_is_whole_json_is_a_call():
    """max_tokens or a stop string may cut the closing tag."""
    content, calls, _ = read("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n')
    assert calls == [("f", {})] and content == ""
    content, calls, _ = read("hermes", '<tool_call>\n{"name": "f", "argu')
    assert calls == [] and content == '<tool_call>\n{"name": "f", "argu'


def test_one_call_when_parallel_calls_are_off():
    content, calls, done = read("hermes", f"{CALL}\n{CALL}", single=True)
    assert done and len(calls) == 1 and content == ""


@pytest.mark.parametrize("seed", range(6))
def test_llama_json_calls(seed):
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "now", "parameters": {}}'
    content, calls, _ = read("llama3_json", text, seed=seed)
    assert content == "" and calls == [("get_weather", {"city": "Oslo"}), ("now", {})]
    assert read("llama3_json", ' {"name": "f", "parameters": {"a": [1, "}"]}}', seed=seed)[1] == [
        ("f", {"a": [1, "}"]})
    ]


@pytest.mark.parametrize("seed", range(4))
def test_llama_text_and_json_that_is_not_a_call_are_content(seed):
    assert read("llama3_json", "It is sunny {really}.", seed=seed) == ("It is sunny {really}.", [], False)
    assert read("llama3_json", '{"answer": 42}', seed=seed) == ('{"answer": 42}', [], False)
    assert read("llama3_json", '{"name": "f", "parameters"', seed=seed) == ('{"name": "f", "parameters"', [], False)


def test_each_call_has_its_own_id():
    reader = HermesCalls()
    got = reader.push(CALL + CALL)
    assert len({call.id for call in got.calls}) == 2 and all(call.id.startswith("call_") for call in got.calls)
    assert JsonCalls().push("") == Parsed()
