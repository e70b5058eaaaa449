"""What applications send through the HTTP front beyond plain generation: structured
output through the openai SDK, and vLLM's /tokenize, /detokenize and /version (the
run's shared daemon, tests/integration/conftest.py: the Llama with a tokenizer, two fronts,
keys)."""

from __future__ import annotations

import json
import re
import subprocess
from typing import Literal

import openai
import pydantic
import pytest
from test_http import curl

from tests.support.http import sdk


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    kind: Literal["cat", "dog", "owl"]
    age: int = pydantic.Field(ge=0, le=99)


class Address(pydantic.BaseModel):
    town: str = pydantic.Field(max_length=8)
    zone: Literal["north", "south"]


class Owner(pydantic.BaseModel):
    """Nested objects, an array of them, an optional field, enums."""

    pets: list[Pet] = pydantic.Field(min_length=1, max_length=2)
    address: Address
    nickname: str | None = pydantic.Field(default=None, max_length=5)


def test_nested_arrays_and_optional_fields_parse_through_the_sdk(http_daemon):
    client = sdk(http_daemon)
    for seed in range(3):
        done = client.chat.completions.parse(
            model="tiny-llama",
            messages=[{"role": "user", "content": "an owner"}],
            response_format=Owner,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
        )
        assert isinstance(done.choices[0].message.parsed, Owner), done.choices[0].message.content


def test_structured_output_parses_through_the_sdk(http_daemon):
    """Random weights: the grammar alone keeps every answer valid."""
    client = sdk(http_daemon)
    messages = [{"role": "user", "content": "a pet"}]
    for seed in range(4):
        done = client.chat.completions.parse(
            model="tiny-llama", messages=messages, response_format=Pet, max_tokens=64, temperature=1.0, seed=seed
        )
        assert done.choices[0].finish_reason == "stop", done.choices[0].message.content
        assert isinstance(done.choices[0].message.parsed, Pet)
        short = client.chat.completions.parse(  # a budget barely over the shortest answer (30 tokens)
            model="tiny-llama", messages=messages, response_format=Pet, max_tokens=34, temperature=1.0, seed=seed
        )
        assert isinstance(short.choices[0].message.parsed, Pet) and short.usage.completion_tokens <= 34
    stream = client.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=32,
        stream=True,
        extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", text), text
    choice = client.completions.create(
        model="tiny-llama", prompt="x", max_tokens=16, extra_body={"guided_choice": ["left", "right"]}
    )
    assert choice.choices[0].text in ("left", "right")
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="tiny-llama", messages=messages, extra_body={"structured_outputs": {"regex": "[0-9"}}
        )
    assert "does not compile" in bad.value.body["message"]


def test_tokenize_detokenize_and_version(http_daemon):
    """vLLM's shapes: the ids are those a generation request gives the model."""
    said = curl(http_daemon, "/tokenize", {"prompt": "hello ring", "return_token_strs": True})
    body = json.loads(said.stdout)
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) and body["max_model_len"] > 0
    client = sdk(http_daemon)
    done = client.completions.create(model="tiny-llama", prompt="hello ring", max_tokens=1)
    assert done.usage.prompt_tokens == body["count"]
    bare = json.loads(curl(http_daemon, "/tokenize", {"prompt": "hello ring", "add_special_tokens": False}).stdout)
    assert bare["tokens"] == body["tokens"][body["count"] - bare["count"] :]  # less the BOS
    text = json.loads(curl(http_daemon, "/detokenize", {"tokens": bare["tokens"]}).stdout)["prompt"]
    assert text == "hello ring"
    messages = [{"role": "user", "content": "hi there"}]
    chat = json.loads(curl(http_daemon, "/tokenize", {"messages": messages}).stdout)
    answer = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=1)
    assert answer.usage.prompt_tokens == chat["count"]
    unknown = json.loads(curl(http_daemon, "/tokenize", {"prompt": "x", "colour": 1}).stdout)
    assert unknown["error"]["param"] == "colour"
    outside = json.loads(curl(http_daemon, "/detokenize", {"tokens": [10**6]}).stdout)
    assert outside["error"]["param"] == "tokens"
    locked = subprocess.run(
        [
            "curl",
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-d",
            "{}",
            f"http://127.0.0.1:{http_daemon.port}/tokenize",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert locked.stdout == "401"  # behind the API keys, as /v1/ is
    version = subprocess.run(
        ["curl", "-sS", f"http://127.0.0.1:{http_daemon.port}/version"], capture_output=True, text=True, timeout=60
    )
    assert json.loads(version.stdout)["version"]


class Weather(pydantic.BaseModel, extra="forbid"):
    city: str = pydantic.Field(max_length=10)
    unit: Literal["C", "F"]


def test_the_sdks_tool_flow_runs_end_to_end(http_daemon):
    """tools -> tool_calls -> a tool message -> the answer, whole and streamed; random weights:
    the named choice (held by the grammar) makes the call, and its arguments validate."""
    client = sdk(http_daemon)
    tools = [openai.pydantic_function_tool(Weather, name="get_weather", description="the weather in a city")]
    messages: list = [{"role": "user", "content": "weather in Oslo?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    asked = dict(model="tiny-llama", tools=tools, tool_choice=named, max_tokens=200, parallel_tool_calls=False)
    done = client.chat.completions.parse(messages=messages, **asked)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.parsed_arguments, Weather)
    with client.chat.completions.stream(messages=messages, **asked) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert isinstance(streamed.message.tool_calls[0].function.parsed_arguments, Weather)
    messages += [
        choice.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    for key in ("parsed_arguments",):
        messages[1]["tool_calls"][0]["function"].pop(key, None)
    answer = client.chat.completions.create(model="tiny-llama", messages=messages, tools=tools, max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny-llama", messages=messages, tool_choice="required")
    assert bad.value.body["param"] == "tool_choice"


def test_curl_sees_a_streamed_tool_call(http_daemon):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": Weather.model_json_schema()}}
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [tool],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 200,
        "stream": True,
    }
    out = curl(http_daemon, "/v1/chat/completions", body)
    events = [block.removeprefix("data: ") for block in out.stdout.split("\n\n") if block]
    assert events[-1] == "[DONE]", out.stdout
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    [[call]] = deltas
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    Weather.model_validate_json(call["function"]["arguments"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_thinking_comes_apart_from_the_answer(http_daemon):
    """[http] reasoning = "think"; random weights write a block because a regex holds them to it."""
    client = sdk(http_daemon)
    shaped = {"structured_outputs": {"regex": "<think>[a-z]{3}</think>\n\n[a-z]{2}"}}
    asked = dict(model="tiny-llama", messages=[{"role": "user", "content": "think"}], max_tokens=40, extra_body=shaped)
    message = client.chat.completions.create(**asked).choices[0].message
    thought, answer = message.reasoning_content, message.content  # type: ignore[attr-defined]
    assert re.fullmatch("[a-z]{3}", thought) and re.fullmatch("[a-z]{2}", answer), message
    parts: dict[str, str] = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**asked, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        for key in parts:
            parts[key] += (getattr(delta, key, None) or "") if delta is not None else ""
    assert re.fullmatch("[a-z]{3}", parts["reasoning_content"]) and re.fullmatch("[a-z]{2}", parts["content"])
