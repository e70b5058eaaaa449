"""Tool calling, the request's side: which form the model writes calls in (its chat
template tells, or the plan's ``model.tool_format``), the tools as the template is given
them, and the grammar that holds a call to its function's schema.

A template that renders tools (Qwen2.5/Qwen3's Hermes form, Llama 3.1's JSON form) is
given them as ``apply_chat_template(tools=...)``. A template that ignores them (SmolLM2's,
most small models') gets them from Kvasir instead: a system message lists them and asks
for Hermes ``<tool_call>`` blocks, earlier calls are written into the assistant's text the
same way and results into the user's ("prompted").

``tool_choice`` ``required`` or a named function: the grammar engine holds the answer to
one call or more (one without ``parallel_tool_calls``), each of a given function with
arguments that follow its ``parameters`` schema. ``auto``: the model chooses; where a tool
is ``strict`` the grammar still holds any call it starts to that tool's schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Literal

from kvasir.errors import RequestError
from kvasir.http.errors import ApiError, invalid
from kvasir.http.schema import ChatRequest, ToolSpec
from kvasir.http.toolcalls import CLOSE, OPEN, CallParser, ToolFormat, parser
from kvasir.sched.grammar import check_grammar
from kvasir.wire.base import Grammar

ToolFormatKey = Literal["auto", "hermes", "llama3_json", "prompted"]  # the plan's model.tool_format
PROBE = {"type": "function", "function": {"name": "kvasir_probe_tool", "parameters": {"type": "object"}}}
COMPACT = {"x-guidance": {"whitespace_flexible": False}}  # JSON as structured output writes it


@dataclass(frozen=True)
class ToolStyle:
    """How this model is told about tools and writes its calls."""

    form: ToolFormat
    native: bool  # the template renders the tools; otherwise Kvasir's own prompt ("prompted")

    @property
    def arguments_key(self) -> str:
        return "parameters" if self.form == "llama3_json" else "arguments"


def tool_style(tokenizer, configured: ToolFormatKey) -> ToolStyle | None:
    """The plan's choice, or (``auto``) what the template shows; None: a template that
    renders tools in a form Kvasir does not read (or no template): tools are refused."""
    if configured != "auto":
        return ToolStyle("hermes", False) if configured == "prompted" else ToolStyle(configured, True)
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not isinstance(template, str):
        return None
    probe = [{"role": "user", "content": "x"}]
    try:
        bare = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        told = tokenizer.apply_chat_template(probe, tools=[PROBE], tokenize=False, add_generation_prompt=True)
    except Exception:  # a template may raise anything: it cannot be given tools
        return ToolStyle("hermes", False)
    if told == bare or "kvasir_probe_tool" not in told:
        return ToolStyle("hermes", False)
    if OPEN in told or OPEN in template:
        return ToolStyle("hermes", True)
    if "python_tag" in template or "ipython" in template:
        return ToolStyle("llama3_json", True)
    return None


@dataclass(frozen=True)
class ToolPlan:
    """One request's tools and what it asks of them."""

    style: ToolStyle
    tools: list[ToolSpec]
    mode: Literal["auto", "required", "named"]
    named: str | None
    parallel: bool
    grammar: Grammar | None = None  # what holds the calls to their schemas (None: free text)

    def template_tools(self) -> list[dict[str, Any]]:
        return [_tool_dict(tool) for tool in self.tools]

    def parser(self) -> CallParser:
        return parser(self.style.form, not self.parallel)

    def holding(self) -> Grammar | None:
        """The Lark grammar holding calls to their schemas (None: free text, ``auto`` with no strict tool)."""
        key = self.style.arguments_key
        if self.mode == "auto":
            strict = [tool for tool in self.tools if tool.function.strict]
            return None if not strict else Grammar("grammar", _free_or_calls(self.style.form, _body(strict, key)))
        chosen = [tool for tool in self.tools if self.mode == "required" or tool.function.name == self.named]
        return Grammar("grammar", _calls_only(self.style.form, _body(chosen, key), self.parallel))


def plan_tools(req: ChatRequest, style: ToolStyle | None) -> ToolPlan | None:
    """The request's tools (None: it gives none, or ``tool_choice`` is ``none``)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice needs tools: give the functions it may call", "tool_choice")
        return None
    if choice == "none":
        return None
    if style is None:
        raise invalid(
            "this model's chat template writes tools in a form Kvasir does not read: the plan's "
            'model.tool_format chooses one ("hermes", "llama3_json" or "prompted")',
            "tools",
        )
    for k, tool in enumerate(req.tools):
        kind = (tool.function.parameters or {}).get("type", "object")
        if kind != "object":
            param = f"tools[{k}].function.parameters"
            raise invalid(f"{param}: a function's arguments are a JSON object (type object), not {kind!r}", param)
    names = [tool.function.name for tool in req.tools]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise invalid(f"tools: two functions are named {twice[0]!r}", "tools")
    named = None if choice is None or isinstance(choice, str) else choice.function.name
    if named is not None and named not in names:
        raise invalid(f"tool_choice names {named!r}, which is not one of the tools", "tool_choice")
    mode: Literal["auto", "required", "named"] = "auto"
    if named is not None or choice == "required":
        mode = "named" if named is not None else "required"
    plan = ToolPlan(style, list(req.tools), mode, named, req.parallel_tool_calls)
    grammar = plan.holding()
    every = Grammar("grammar", _calls_only(style.form, _body(plan.tools, style.arguments_key), False))
    try:  # every schema, held to or not: one the engine cannot read is refused, never shown to the model
        check_grammar(grammar if grammar is not None and mode == "required" else every)
        if grammar is not None and mode != "required":
            check_grammar(grammar)
    except RequestError as exc:
        raise ApiError(exc.code, f"the tools' schemas cannot hold a call: {exc.message}", "tools") from None
    return replace(plan, grammar=grammar)


def prompted(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages for a template that ignores tools: the tools in the system message, earlier
    calls in the assistant's text, and results as the user's words ("get_weather returned: ...",
    which models never taught a tool format read best)."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            name = message.get("name") or names.get(message.get("tool_call_id") or "", "the function")
            result = f"{name} returned: {content}"
            if out and out[-1].get("from_tool"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "from_tool": True})
            continue
        calls = message.get("tool_calls") or ()
        names.update((call["id"], call["function"]["name"]) for call in calls)
        text = "\n".join(part for part in (content, *(_call_text(call["function"]) for call in calls)) if part)
        out.append({key: value for key, value in message.items() if key != "tool_calls"} | {"content": text})
    for message in out:
        message.pop("from_tool", None)
    if tools:
        prompt = tool_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def tool_prompt(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(tool, ensure_ascii=False, separators=(",", ":")) for tool in tools)
    return (
        f"Functions you may call (JSON schemas):\n<tools>\n{listed}\n</tools>\n"
        f'To call one, answer with {OPEN}\n{{"name": NAME, "arguments": {{...}}}}\n{CLOSE} for each call.'
    )


def _call_text(function: dict[str, Any]) -> str:
    body = {"name": function["name"], "arguments": function["arguments"]}
    return f"{OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CLOSE}"


def _tool_dict(tool: ToolSpec) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description is not None:
        function["description"] = tool.function.description
    function["parameters"] = tool.function.parameters if tool.function.parameters is not None else {"type": "object"}
    return {"type": "function", "function": function}


def _body(tools: list[ToolSpec], key: str) -> str:
    """One call's JSON schema: the name of one of ``tools`` and arguments that follow its schema."""
    each = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                key: tool.function.parameters if tool.function.parameters is not None else {"type": "object"},
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema = each[0] if len(each) == 1 else {"anyOf": each}
    return json.dumps({**schema, **COMPACT}, ensure_ascii=False)


def _calls_only(form: ToolFormat, body: str, parallel: bool) -> str:
    """Nothing but calls: one, or (parallel) one or more."""
    if form == "llama3_json":
        more = ' ("; " body)*' if parallel else ""
        return f"start: body{more}\nbody: %json {body}\n"
    more = ' ("\\n" call)*' if parallel else ""
    return f'start: call{more}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: %json {body}\n'


def _free_or_calls(form: ToolFormat, body: str) -> str:
    """Text, or calls that follow their schemas (``auto`` with strict tools)."""
    if form == "llama3_json":
        return f'start: free | body ("; " body)*\nfree: /[^{{](?s:.*)/\nbody: %json {body}\n'
    return (
        f'start: free | lead calls\nfree: /(?s:.*)/\nlead[stop="{OPEN}\\n"]: /(?s:.*)/\n'
        f'calls: body "\\n{CLOSE}" ("\\n{OPEN}\\n" body "\\n{CLOSE}")*\nbody: %json {body}\n'
    )
