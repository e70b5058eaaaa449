"""Tool calls read out of a chat choice's text as it streams: the Hermes form (Qwen2.5,
Qwen3, and Kvasir's own tool prompt) and the JSON form of Llama 3.1 and later.

Hermes: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, text
before the first call is the message's content. Llama 3.1: the whole answer is a call
``{"name": ..., "parameters": {...}}`` (several joined by ``;``), or plain text. A call
whose JSON does not read as one stays in the content, as the model wrote it: nothing the
model said is dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

ToolFormat = Literal["hermes", "llama3_json"]
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama's marker before a call (absent once special tokens are skipped)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as a string (the OpenAI shape)


def new_call(name: str, arguments: Any) -> ToolCall:
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False))


def read_call(text: str, arguments_key: str) -> ToolCall | None:
    """One call's JSON text, or None."""
    try:
        return call_of(json.loads(text), arguments_key)
    except ValueError:
        return None


def call_of(body: Any, arguments_key: str) -> ToolCall | None:
    """One call's decoded JSON (``{"name": ..., "arguments" | "parameters": {...}}``), or None."""
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
        return None
    arguments = body.get(arguments_key, body.get("arguments", body.get("parameters", {})))
    if not isinstance(arguments, dict):
        return None
    return new_call(body["name"], arguments)


@dataclass
class Parsed:
    """What a piece of text turned into: content to send, calls now complete, and (a
    thinking model's) reasoning."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""


class HermesCalls:
    """``<tool_call>`` blocks; text that could begin a block is held until it shows it does
    not. With ``single`` the choice is done after its first call (parallel_tool_calls false)."""

    def __init__(self, single: bool = False) -> None:
        self.single = single
        self.pending = ""
        self.inside = False
        self.count = 0

    @property
    def done(self) -> bool:
        return self.single and self.count > 0

    def push(self, text: str) -> Parsed:
        self.pending += text
        out = Parsed()
        while not self.done:
            if self.inside:
                end = self.pending.find(CLOSE)
                if end < 0:
                    break
                self._close(self.pending[:end], out, CLOSE)
                self.pending = self.pending[end + len(CLOSE) :]
                continue
            start = self.pending.find(OPEN)
            if start < 0:
                keep = held(self.pending, OPEN)
                self._say(self.pending[: len(self.pending) - keep], out)
                self.pending = self.pending[len(self.pending) - keep :]
                break
            self._say(self.pending[:start], out)
            self.pending, self.inside = self.pending[start + len(OPEN) :], True
        return out

    def flush(self) -> Parsed:
        """The end of the choice: an open block whose JSON is whole is a call (a stop string
        or max_tokens may cut its closing tag); anything else is content."""
        out = Parsed()
        if self.inside and not self.done:
            self._close(self.pending, out, "")
        elif not self.done:
            self._say(self.pending, out)
        self.pending, self.inside = "", False
        return out

    def _close(self, body: str, out: Parsed, closing: str) -> None:
        self.inside = False
        call = read_call(body.strip(), "arguments")
        if call is None:
            self._say(OPEN + body + closing, out)
            return
        out.calls.append(call)
        self.count += 1

    def _say(self, text: str, out: Parsed) -> None:
        if self.count and not text.strip():
            return  # the newlines between and after calls
        out.content += text


class JsonCalls:
    """Llama 3.1's answer: a JSON call (or several, ``;`` between), or text. Whether it is a
    call shows at its first character that is not whitespace; a call is held until its
    object is whole."""

    def __init__(self, single: bool = False) -> None:
        self.single = single
        self.pending = ""
        self.mode: Literal["unknown", "text", "calls"] = "unknown"
        self.count = 0
        self._decoder = json.JSONDecoder()

    @property
    def done(self) -> bool:
        return self.single and self.count > 0

    def push(self, text: str) -> Parsed:
        if self.mode == "text":
            return Parsed(text)
        self.pending += text
        if self.mode == "unknown":
            lead = self.pending.lstrip()
            if lead.startswith(PYTHON_TAG):
                lead = lead[len(PYTHON_TAG) :].lstrip()
            if not lead or PYTHON_TAG.startswith(lead):
                return Parsed()
            self.mode = "calls" if lead.startswith("{") else "text"
            if self.mode == "text":
                text, self.pending = self.pending, ""
                return Parsed(text)
            self.pending = lead
        return self._objects() if "}" in text else Parsed()

    def flush(self) -> Parsed:
        """The end: whatever is left that is not a whole call is content."""
        out = self._objects() if self.mode == "calls" else Parsed()
        rest = "" if self.done else self.pending
        if rest.strip(" \n;"):
            out.content += rest if not self.count else rest.lstrip(" \n;")
        self.pending = ""
        return out

    def _objects(self) -> Parsed:
        out = Parsed()
        while not self.done:
            text = self.pending.lstrip(" \n;")
            try:
                body, end = self._decoder.raw_decode(text)
            except ValueError:
                break
            call = call_of(body, "parameters")
            if call is None:  # JSON, but not a call: the answer is text after all
                self.mode = "text"
                out.content, self.pending = self.pending, ""
                break
            out.calls.append(call)
            self.count += 1
            self.pending = text[end:]
        return out


CallParser = HermesCalls | JsonCalls


def parser(form: ToolFormat, single: bool) -> CallParser:
    return HermesCalls(single) if form == "hermes" else JsonCalls(single)


def held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
