"""Tool calling, the request's side (kvasir/http/tools.py): the form a template takes tools
in, the prompt a template that ignores them gets, the checks, and grammars that hold every
call to its function's schema (random logits through the real engine)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Literal

import msgspec
import pydantic
import pytest
import torch

from kvasir.http.errors import ApiError
from kvasir.http.prompts import Prompts
from kvasir.http.requests import Served, plan_chat
from kvasir.http.schema import ChatRequest
from kvasir.http.tools import ToolStyle, tool_style
from kvasir.stage.grammar import Grammars
from tests.support.models import save_tiny_tokenizer

TEMPLATES = Path(__file__).parents[2] / "support" / "templates"
SERVED = Served.of("tiny", 512, 256, None)


class Weather(pydantic.BaseModel, extra="forbid"):
    city: str = pydantic.Field(max_length=8)
    unit: Literal["C", "F"]


class Clock(pydantic.BaseModel, extra="forbid"):
    zone: int = pydantic.Field(ge=-12, le=12)


def tool(name: str, model: type[pydantic.BaseModel], strict: bool | None = None) -> dict:
    function = {"name": name, "description": f"the {name}", "parameters": model.model_json_schema()}
    return {"type": "function", "function": function | ({"strict": strict} if strict is not None else {})}


TOOLS = [tool("get_weather", Weather), tool("get_time", Clock)]
MODELS = {"get_weather": Weather, "get_time": Clock}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tool-tokenizer")
    save_tiny_tokenizer(folder)
    return folder


def templated(tokenizer, name: str | None):
    shaped = copy.deepcopy(tokenizer)
    if name is not None:
        shaped.chat_template = (TEMPLATES / name).read_text()
    return shaped


def plan(tokenizer, body: dict, messages: list[dict] | None = None, known: bool = True):
    """``known``: the form is read from the template (otherwise: a form Kvasir does not read)."""
    style = tool_style(tokenizer, "auto") if known else None
    messages = messages or [{"role": "user", "content": "weather in Oslo?"}]
    req = msgspec.json.decode(json.dumps({"messages": messages, **body}), type=ChatRequest)
    return plan_chat(req, Prompts(tokenizer, 512, len(tokenizer), style), SERVED)


def test_the_form_is_read_from_the_template(tiny_tokenizer):
    assert tool_style(tiny_tokenizer, "auto") == ToolStyle("hermes", native=False)  # it ignores tools
    assert tool_style(templated(tiny_tokenizer, "hermes.jinja"), "auto") == ToolStyle("hermes", native=True)
    assert tool_style(templated(tiny_tokenizer, "llama3.jinja"), "auto") == ToolStyle("llama3_json", native=True)
    own = templated(tiny_tokenizer, None)
    own.chat_template = (
        "{% if tools %}TOOLS {{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    assert tool_style(own, "auto") is None  # tools in a form Kvasir does not read
    assert tool_style(own, "hermes") == ToolStyle("hermes", native=True)  # unless the plan says
    assert tool_style(own, "prompted") == ToolStyle("hermes", native=False)
    assert tool_style(None, "auto") is None


def test_a_template_that_ignores_tools_gets_them_from_kvasir(tiny_tokenizer):
    conversation = [
        {"role": "user", "content": "weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "windy"},
    ]
    text = tiny_tokenizer.decode(plan(tiny_tokenizer, {"tools": TOOLS}, conversation).submissions[0].prompt)
    assert text.startswith("<s>system: Functions you may call") and '"name":"get_time"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "user: get_weather returned: sunny\nthe function returned: windy\n" in text  # c2: no such call
    bare = tiny_tokenizer.decode(plan(tiny_tokenizer, {"tools": TOOLS, "tool_choice": "none"}).submissions[0].prompt)
    assert "get_time" not in bare  # tool_choice none: the model is not told of them


def test_a_template_that_renders_tools_is_given_them(tiny_tokenizer):
    hermes = templated(tiny_tokenizer, "hermes.jinja")
    conversation = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "get_time", "arguments": '{"zone": 1}'}}]},
        {"role": "tool", "content": "12:00"},
    ]
    text = hermes.decode(plan(hermes, {"tools": TOOLS}, conversation).submissions[0].prompt)
    assert "<tools>" in text and '{"name": "get_time", "arguments": {"zone": 1}}' in text
    assert "<tool_response>\n12:00\n</tool_response>" in text


@pytest.mark.parametrize(
    ("body", "messages", "param"),
    [
        ({"tool_choice": "required"}, None, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, None, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, None, "tools[0].function.name"),
        ({"tools": [tool("f", Weather) | {"type": "web"}]}, None, "tools[0].type"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"properties": {"a": {"type": "frog"}}}},
                    }
                ]
            },
            None,
            "tools",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            None,
            "tools[0].function.parameters",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            None,
            "tool_choice",
        ),
        (
            {},
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_what_cannot_be_served_is_refused_naming_it(tiny_tokenizer, body, messages, param):
    with pytest.raises((ApiError, msgspec.ValidationError)) as refused:
        plan(tiny_tokenizer, body, messages)
    if isinstance(refused.value, ApiError):
        assert refused.value.param == param, refused.value
    else:
        assert f"`$.{param}`" in str(refused.value)


def test_tools_are_refused_where_the_template_form_is_unknown(tiny_tokenizer):
    with pytest.raises(ApiError, match="model.tool_format") as refused:
        plan(tiny_tokenizer, {"tools": TOOLS}, known=False)
    assert refused.value.param == "tools"
    assert plan(tiny_tokenizer, {}, known=False).tools is None  # a chat without tools is served


def sample(grammars: Grammars, grammar, seed: int, steps: int = 300) -> list[int]:
    """Random logits, masked by the grammar, until it is complete (or the EOS, id 2, is drawn)."""
    generator = torch.Generator().manual_seed(seed)
    constraint = grammars.constraint(grammar, ())
    out: list[int] = []
    while not constraint.done and len(out) < steps:
        logits = constraint.mask(torch.randn(grammars.vocab_size, generator=generator))
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if token == 2:
            break
        constraint.follow(token)
        out.append(token)
    return out


@pytest.mark.parametrize("template", ["hermes.jinja", "llama3.jinja", None])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"]
)
def test_required_and_named_calls_always_follow_their_schemas(tiny_tokenizer, folder, template, choice):
    shaped = templated(tiny_tokenizer, template)
    grammars = Grammars(folder, len(tiny_tokenizer))
    planned = plan(shaped, {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False})
    grammar = planned.submissions[0].options["grammar"]
    for seed in range(4):
        reader = planned.tools.parser()
        said = reader.push(shaped.decode(sample(grammars, grammar, seed)))
        rest = reader.flush()
        calls = said.calls + rest.calls
        assert len(calls) == 1 and not (said.content + rest.content).strip()
        assert choice == "required" or calls[0].name == "get_time"
        MODELS[calls[0].name].model_validate_json(calls[0].arguments)


def test_auto_with_a_strict_tool_holds_any_call_to_its_schema(tiny_tokenizer, folder):
    planned = plan(tiny_tokenizer, {"tools": [tool("get_weather", Weather, strict=True)]})
    grammar = planned.submissions[0].options["grammar"]
    assert grammar is not None and plan(tiny_tokenizer, {"tools": TOOLS}).submissions[0].options["grammar"] is None
    grammars = Grammars(folder, len(tiny_tokenizer))
    constraint = grammars.constraint(grammar, tuple(tiny_tokenizer.encode("Sure. <tool_call>\n")))
    free = constraint.mask(torch.zeros(len(tiny_tokenizer)))
    allowed = [tiny_tokenizer.decode([t]) for t in range(len(tiny_tokenizer)) if free[t] > float("-inf")]
    assert allowed and all(text.startswith("{") for text in allowed)  # a call's JSON, nothing else
    text_only = grammars.constraint(grammar, tuple(tiny_tokenizer.encode("no call, just words")))
    assert not text_only.done  # text may go on
